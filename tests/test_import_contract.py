"""Imports point one way: {cli, serve} → pipeline → {parallel, weights, sampling, text} → models → kernels.

Read from the source with `ast`, so a violation fails here whatever happens to be imported at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "flux_runtime"

# subpackage -> subpackages it must never import
# (`serve`, the HTTP server, sits beside `cli` at the top: it may import the pipeline, nothing imports it)
# (`parallel`, the multi-GPU layer, sits between the pipeline and the models)
FORBIDDEN = {
    "kernels": {"models", "weights", "sampling", "text", "pipeline", "cli", "serve", "parallel"},
    "models": {"weights", "sampling", "text", "pipeline", "cli", "serve", "parallel"},
    "sampling": {"models", "weights", "text", "pipeline", "cli", "serve", "parallel"},
    "weights": {"sampling", "text", "pipeline", "cli", "serve", "parallel"},
    "text": {"sampling", "pipeline", "cli", "serve", "parallel"},
    "parallel": {"weights", "sampling", "text", "pipeline", "cli", "serve"},
    "pipeline": {"cli", "serve"},
    "cli": {"serve"},
    "serve": {"cli"},
}


def _imports(path: Path) -> set[str]:
    """The flux_runtime subpackages a module imports (absolute imports; the package uses no relative ones)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "flux_runtime" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_imports_point_one_way(subpackage):
    bad = []
    for path in sorted((PACKAGE / subpackage).rglob("*.py")):
        hit = _imports(path) & FORBIDDEN[subpackage]
        if hit:
            bad.append(f"{path.relative_to(PACKAGE)} imports {sorted(hit)}")
    assert not bad, "\n".join(bad)


def test_the_contract_sees_imports():
    # guard against a parser that finds nothing: the pipeline does import models and kernels
    found = set().union(*(_imports(p) for p in (PACKAGE / "pipeline").rglob("*.py")))
    assert {"models", "kernels", "sampling", "weights", "text"} <= found


def test_importing_the_pipeline_imports_no_transformers():
    """transformers takes seconds to import: only a load that opens a text encoder pays for it, and only for
    that family's classes, so `import flux_runtime.pipeline` (and `flux-gen --help`) must not import it."""
    import subprocess
    import sys

    code = (
        "import sys; import flux_runtime.cli.gen; from flux_runtime.pipeline import Pipeline; "
        "import flux_runtime.text.flux1, flux_runtime.text.flux2, flux_runtime.pipeline.flux2; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _gen_imports(model: str, out: Path) -> str:
    """The last line a `flux-gen --model <model>` run in a fresh process prints: the transformers modules and
    `torch._dynamo` it imported."""
    import subprocess
    import sys

    code = (
        "import sys; from flux_runtime.cli.gen import main\n"
        f"sys.argv = ['flux-gen', '--model', {model!r}, '--prompt', 'a red circle', '--steps', '1', '--width', '64',"
        f" '--height', '64', '--quiet', '--out', {str(out)!r}]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers' or m == 'torch._dynamo'))"
    )
    out_text = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return out_text.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_klein_run_from_safetensors_imports_no_transformers(tmp_path):
    """FLUX.2 [klein]'s Qwen3, its tokenizer and chat template are ours when the weights are safetensors and the
    tokenizer folder has tokenizer.json and a chat template (the built-in `tiny-flux2`: a Qwen3 folder in the
    layout of the real ones): a whole `flux-gen` run then imports neither transformers nor `torch._dynamo`."""
    assert (PACKAGE / "assets" / "models" / "tiny-flux2" / "text_encoder" / "model.safetensors").is_file()
    assert _gen_imports("tiny-flux2", tmp_path / "k.png") == "[]" and (tmp_path / "k.png").is_file()


@pytest.mark.slow
def test_a_flux1_run_from_safetensors_imports_no_transformers(tmp_path):
    """FLUX.1's CLIP-L and T5 and their tokenizers are ours when the weights are safetensors and the tokenizers
    carry their files (the built-in `tiny`, as a real FLUX.1 folder): a whole `flux-gen` run then never imports
    transformers, whose import is most of a fresh process's start, nor `torch._dynamo` (seconds more, pulled in
    by the first random init on the `meta` device)."""
    assert _gen_imports("tiny", tmp_path / "x.png") == "[]" and (tmp_path / "x.png").is_file()


def test_loading_diffusers_folders_imports_no_dynamo(tmp_path):
    """A load runs shape checks and builds models on `meta`; torch runs some meta ops (`cat`, random init)
    through its reference ops, whose first use imports `torch._dynamo`: seconds of every fresh `flux-gen`
    (the H200's FLUX.1-dev load took 8.4 s instead of 2.3 s). Loading a FLUX.1 and a FLUX.2 [klein] diffusers
    folder must not."""
    import subprocess
    import sys

    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    from flux_runtime.text.flux2 import KleinTextEncoder
    from tests.flux2_fixtures import make_diffusers_flux2
    from tests.pipeline.test_flux1_pipeline import _save_pipeline
    from tests.weights.vae_fixtures import make_diffusers_flux2_vae

    flux1 = _save_pipeline(tmp_path / "flux1", guidance=True)
    qwen = KleinTextEncoder.tiny(seed=5)
    klein = tmp_path / "klein"
    Flux2KleinPipeline(
        text_encoder=qwen.model, tokenizer=qwen.tokenizer, transformer=make_diffusers_flux2(guidance=False, seed=6),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=make_diffusers_flux2_vae(seed=2),
    ).save_pretrained(klein)  # fmt: skip
    for folder in (flux1, klein):
        code = (
            "import sys; from flux_runtime.pipeline import Pipeline; "
            f"Pipeline.from_pretrained({str(folder)!r}, device='cpu', download=False); "
            "print(sorted(m for m in sys.modules if m in ('torch._dynamo', 'transformers', 'sympy')))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert out.strip().splitlines()[-1] == "[]", folder.name
