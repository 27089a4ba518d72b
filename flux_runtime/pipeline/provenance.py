"""What a generated image records about itself: the PNG text chunk that `flux-gen --replay` reads.

One schema (`RECORD_FIELDS`, `OPTIONAL_FIELDS`) is checked by `check_record` both when a PNG is written
(`save_png`) and when one is read back (`parse_provenance`), so a record the reader accepts is one the
writer could have made, and a damaged or hand-edited record fails as one FluxError naming the field.
PNGs are written to a temporary file in the same folder and then linked or renamed into place, so an
interrupted write leaves no file behind and two writers of one path cannot both succeed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import secrets
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from PIL.PngImagePlugin import PngInfo

import flux_runtime
from flux_runtime.pipeline.checks import QUALITIES
from flux_runtime.pipeline.errors import FluxError
from flux_runtime.pipeline.png_encode import encode_png
from flux_runtime.pipeline.sources import Sources
from flux_runtime.weights.builtin import builtin
from flux_runtime.weights.checkpoint import find_transformer_files
from flux_runtime.weights.config_files import BOOL, INT, NUMBER, STR, Kind
from flux_runtime.weights.hub import resolve
from flux_runtime.weights.safetensors_io import files_fingerprint

# The PNG text chunk holding the record.
CHUNK = "flux_runtime"
DTYPE_NAMES = ("bfloat16", "float16", "float32")
# What a FLUX.2 / FLUX.3 call takes as `image`: one reference image or several.
ReferenceImages = Image.Image | Sequence[Image.Image]


def _one_of(*values: str) -> Kind:
    return Kind(" or ".join(repr(v) for v in values), lambda v: v in values)


def _int_at_least(low: int) -> Kind:
    return Kind(f"an integer >= {low}", lambda v: INT.ok(v) and v >= low)  # type: ignore[operator]


def _is_reference(v: object) -> bool:
    return (
        isinstance(v, dict)
        and (v.get("path") is None or isinstance(v.get("path"), str))
        and all(_int_at_least(1).ok(v.get(k)) for k in ("width", "height"))
        and isinstance(v.get("sha256"), str)
    )


def _is_tensor(v: object) -> bool:
    """An input tensor's record (`tensor_record`): its shape, dtype and fingerprint."""
    return (
        isinstance(v, dict)
        and isinstance(v.get("shape"), list)
        and all(_int_at_least(0).ok(n) for n in v["shape"])
        and isinstance(v.get("dtype"), str)
        and isinstance(v.get("sha256"), str)
    )


def _is_redux(v: object) -> bool:
    """FLUX.1 Redux: the files named, their fingerprint, each image, and a scale per image."""
    return (
        isinstance(v, dict)
        and isinstance(v.get("path"), str)
        and (v.get("image_encoder") is None or isinstance(v.get("image_encoder"), str))
        and isinstance(v.get("weights"), str)
        and isinstance(v.get("images"), list)
        and len(v["images"]) > 0
        and all(_is_reference(r) for r in v["images"])
        and all(
            isinstance(v.get(k), list) and len(v[k]) == len(v["images"]) and all(NUMBER.ok(x) for x in v[k])
            for k in ("prompt_embeds_scale", "pooled_prompt_embeds_scale")
        )
    )


def _is_lora(v: object) -> bool:
    return (
        isinstance(v, dict)
        and all(isinstance(v.get(k), str) for k in ("name", "path", "sha256", "format"))
        and NUMBER.ok(v.get("scale"))
    )


PROMPT = Kind(
    "a string, a list of strings or null",
    lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(p, str) for p in v)),
)
# Every record has these (what `provenance()` writes) ...
RECORD_FIELDS: dict[str, Kind] = {
    "prompt": PROMPT,
    "seed": _int_at_least(0).or_null(),
    "height": _int_at_least(1),
    "width": _int_at_least(1),
    "num_steps": _int_at_least(1),
    "guidance": NUMBER.or_null(),
    "max_sequence_length": _int_at_least(1),
    "model": STR,
    "weights": STR,
    "quality": _one_of(*QUALITIES),
    "cuda_graphs": BOOL,
    "dtype": _one_of(*DTYPE_NAMES),
    "device": STR,
    "flux_runtime": STR,
    "torch": STR,
}
# ... and may have these (the kernels that ran, FLUX.2's references, flux-gen's place of the image in its batch).
OPTIONAL_FIELDS: dict[str, Kind] = {
    "kernels": STR,
    "decode_kernels": STR,
    # the attention backend that ran ("sdpa", "fa3-fp8" or both) and why (`kernels.attention_backends`)
    "attention": STR,
    "attention_reason": STR,
    "reference_images": Kind(
        "a list of {path, width, height, sha256} objects",
        lambda v: isinstance(v, list) and all(_is_reference(r) for r in v),
    ),
    # FLUX.3: the (left, top, right, bottom) box of a single reference that the output was cropped back to
    "reference_crop": Kind(
        "a list of 4 integers >= 0",
        lambda v: isinstance(v, list) and len(v) == 4 and all(_int_at_least(0).ok(x) for x in v),
    ),
    # FLUX.3's prompt upsampler: whether it ran, the caption that was encoded, which upsampler wrote it
    "upsample": _one_of("on", "given", "off", "unavailable"),
    "upsampled_prompt": STR,
    "prompt_upsampler": Kind(
        "a {model, weights, system_prompt} object of strings",
        lambda v: (
            isinstance(v, dict)
            and all(isinstance(v.get(k), str) for k in ("model", "weights", "system_prompt"))
        ),
    ),
    "index": _int_at_least(0),
    "num_images": _int_at_least(1),
    "precision": STR,
    "fp8_at_load": BOOL,
    "fp8_text": BOOL,
    "memory_plan": STR,  # where the weights lived (moves no bits)
    # the Hugging Face repo and commit the transformer was read from (a model id, or a path in the cache)
    "hub": Kind(
        "a {repo, revision} object of strings",
        lambda v: isinstance(v, dict) and all(isinstance(v.get(k), str) for k in ("repo", "revision")),
    ),
    # FLUX.1 variants: true CFG, img2img / inpainting strength, the input images by role
    "negative_prompt": PROMPT,
    "true_cfg_scale": NUMBER,
    "strength": NUMBER,
    "variant": STR,
    "loras": Kind(
        "a list of {name, path, sha256, scale, format} objects",
        lambda v: isinstance(v, list) and all(_is_lora(r) for r in v),
    ),
    "lora_fp8": STR,
    "lora_gguf": STR,
    "redux": Kind(
        "a {path, image_encoder, weights, images, prompt_embeds_scale, pooled_prompt_embeds_scale} object",
        _is_redux,
    ),
    # ControlNets: each one's kind, path, fingerprint, control image, scale, mode and step fraction
    "controlnets": Kind(
        "a list of {kind, path, weights, image, scale, guidance_start, guidance_end[, mode]} objects",
        lambda v: (
            isinstance(v, list)
            and all(
                isinstance(n, dict)
                and isinstance(n.get("kind"), str)
                and all(NUMBER.ok(n.get(k)) for k in ("scale", "guidance_start", "guidance_end"))
                and _is_reference(n.get("image"))
                for n in v
            )
        ),
    ),
    # FLUX.1's IP-Adapter: its file, fingerprint, scale (or one per double block) and CLIP vision encoder
    "ip_adapter": Kind(
        "a {name, path, sha256, scale, image_encoder} object",
        lambda v: (
            isinstance(v, dict)
            and all(isinstance(v.get(k), str) for k in ("name", "path", "sha256", "image_encoder"))
            and (
                NUMBER.ok(v.get("scale"))
                or (isinstance(v.get("scale"), list) and all(NUMBER.ok(s) for s in v["scale"]))
            )
        ),
    ),
    "ip_adapter_images": Kind(
        "an object of {path, width, height, sha256} objects by role (ip_adapter_image, negative_ip_adapter_image)",
        lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_reference(r) for k, r in v.items()),
    ),
    # IP-Adapter image embeddings given in place of an image: what they were, not how to make them again
    "ip_adapter_image_embeds": Kind(
        "an object of {shape, dtype, sha256} objects by role (ip_adapter_image_embeds, "
        "negative_ip_adapter_image_embeds)",
        lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_tensor(r) for k, r in v.items()),
    ),
    "input_images": Kind(
        "an object of {path, width, height, sha256} objects by role (image, mask_image, control_image)",
        lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_reference(r) for k, r in v.items()),
    ),
}


def check_record(record: object, where: Path | str) -> dict[str, Any]:
    """`record` if it follows the provenance schema, else a FluxError naming `where` and the field."""
    if not isinstance(record, dict):
        raise FluxError(f"{where}: the flux-runtime provenance is not a JSON object")
    missing = [name for name in RECORD_FIELDS if name not in record]
    if missing:
        raise FluxError(f"{where}: the flux-runtime provenance lacks {', '.join(missing)}")
    for name, kind in {**RECORD_FIELDS, **OPTIONAL_FIELDS}.items():
        if name in record and not kind.ok(record[name]):
            value = json.dumps(record[name], default=str)
            value = value if len(value) <= 60 else value[:57] + "..."
            raise FluxError(f"{where}: provenance field {name!r} must be {kind.what}, got {value}")
    if "index" in record and "num_images" in record and record["index"] >= record["num_images"]:
        raise FluxError(
            f"{where}: provenance index {record['index']} is not below num_images {record['num_images']}"
        )
    return record


def parse_provenance(text: str, where: Path | str) -> dict[str, Any]:
    """The record in a PNG's `flux_runtime` text chunk, checked against the schema."""
    try:
        record = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise FluxError(f"{where}: the flux-runtime provenance is not valid JSON ({e})") from None
    return check_record(record, where)


def read_provenance(png: Path) -> dict[str, Any]:
    """The generation record `flux-gen` wrote into a PNG's text chunks, checked against the schema."""
    try:
        with Image.open(png) as im:
            raw = im.text.get(CHUNK) if hasattr(im, "text") else None
    except Image.DecompressionBombError as e:
        raise FluxError(f"cannot read {png}: {e}") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, zlib.error) as e:
        raise FluxError(f"cannot read {png}: {e or type(e).__name__}") from None
    if raw is None:
        raise FluxError(f"{png} carries no flux-runtime provenance (was it made by flux-gen?)")
    return parse_provenance(raw, png)


def weights_id(src: Sources) -> str:
    """A short fingerprint of the transformer weights: sha256 over its files' names, sizes and headers."""
    spec = builtin(src.name)
    if spec is not None:  # built-in models name themselves: `tiny-seed0`, `tiny-trained-<sha256 of its file>`
        return spec.weights_id()
    return files_fingerprint(find_transformer_files(resolve(src.transformer)))


def provenance(
    *,
    prompt: object,
    seed: int | None,
    height: int,
    width: int,
    steps: int,
    guidance: float | None,
    max_sequence_length: int,
    tier: str,
    cuda_graphs: bool,
    model: str,
    weights: str,
    dtype: torch.dtype,
    device: torch.device,
    precision: str = "bf16",
    fp8_at_load: bool = False,
) -> dict[str, Any]:
    """The generation record every pipeline writes into `PipelineOutput.info` (JSON-serialisable)."""
    return {
        "prompt": prompt,
        "seed": seed,
        "height": height,
        "width": width,
        "num_steps": steps,
        "guidance": guidance,
        "max_sequence_length": max_sequence_length,
        "model": model,
        "weights": weights,
        "quality": tier,
        "precision": precision,
        "fp8_at_load": fp8_at_load,
        "cuda_graphs": cuda_graphs,
        "dtype": str(dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "flux_runtime": flux_runtime.__version__,
        "torch": torch.__version__,
    }


PNG_COMPRESS_LEVEL = 4


def png_bytes(image: Image.Image, info: Mapping[str, Any], *, where: Path | str = "<memory>") -> bytes:
    """`image` as PNG bytes with the provenance in text chunks (`flux_runtime` JSON + a readable summary).

    What `save_png` writes and `flux-serve` sends; `where` names the image in a schema error.
    """
    record = check_record(dict(info), where)  # the writer keeps the schema the reader checks
    text = [
        (CHUNK, json.dumps(record, default=str)),
        ("Description", str(record.get("prompt", ""))),
        ("Software", f"flux-runtime {flux_runtime.__version__}"),
    ]
    # zlib level 4, not PIL's 6: a smooth 1024² image took 0.053 s against 0.106 s, for a file 6 % larger (one
    # core of the development machine, 2026-12-05), time the user waits for after every image; same pixels.
    # L, RGB and RGBA images are filtered and deflated in bands on several threads (`png_encode`)
    data = encode_png(image, text, PNG_COMPRESS_LEVEL)
    if data is not None:
        return data
    meta = PngInfo()
    for key, value in text:
        meta.add_text(key, value)
    buf = io.BytesIO()
    image.save(buf, format="PNG", pnginfo=meta, compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def save_png(image: Image.Image, path: Path, info: Mapping[str, Any], *, overwrite: bool = False) -> None:
    """Write `image` with the provenance in PNG text chunks (`flux_runtime` JSON + a readable summary).

    The PNG is written to a hidden temporary file beside `path` and only then put in place, so `path`
    never holds a partial image (an interrupted or failed write removes the temporary file). Without
    `overwrite` the placing is an exclusive create: if `path` exists, even one another process made
    meanwhile, nothing is replaced and a FluxError says so.
    """
    path = Path(path)
    data = png_bytes(image, info, where=path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _place(tmp, path, overwrite)
    finally:
        tmp.unlink(missing_ok=True)


def _place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Put the finished `tmp` at `path` in one step: a rename, or without `overwrite` a hard link (which
    fails if `path` exists); a filesystem without hard links gets an exclusive create, then the rename."""
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise _clash(path) from None
    except OSError:
        pass  # no hard links here
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        raise _clash(path) from None
    try:
        os.replace(tmp, path)
    except BaseException:
        path.unlink(missing_ok=True)  # the empty placeholder made just above
        raise


def _clash(path: Path) -> FluxError:
    return FluxError(
        f"{path} already exists (another run wrote it meanwhile?); it was left as it is and this image was "
        "not saved: choose another output path"
    )


def image_fingerprint(image: Image.Image) -> str:
    """sha256 over a PIL image's mode, size and pixels: what the pipeline saw, whatever file it came from."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def image_record(image: Image.Image) -> dict[str, Any]:
    """What the provenance keeps of an input image: its file (or None), size and `image_fingerprint`."""
    return {
        "path": getattr(image, "filename", "") or None,
        "width": image.width,
        "height": image.height,
        "sha256": image_fingerprint(image),
    }


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """sha256 over a tensor's dtype, shape and bytes (row-major, as on the CPU): the values the call read,
    wherever they were."""
    t = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}:{'x'.join(map(str, t.shape))}:".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def tensor_record(tensor: torch.Tensor) -> dict[str, Any]:
    """What the provenance keeps of an input tensor: its shape, dtype and `tensor_fingerprint`."""
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "sha256": tensor_fingerprint(tensor),
    }
