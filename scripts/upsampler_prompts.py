#!/usr/bin/env python3
"""Write the FLUX.3 prompt upsampler's prompts file from an installed diffusers, for `--upsampler-prompts`.

The upsampler's system prompts, its edit scaffolds and its layout request are Black Forest Labs' text; this
project does not ship them. `system_prompts.json` beside the upsampler's weights holds the system prompts; a
machine that has diffusers 0.42.1 installed also has the scaffolds and the layout request (in
`diffusers.modular_pipelines.flux3.prompt_upsampler`). This script reads all of them from there, writes them as
one JSON file in the layout `flux_runtime.text.flux3_upsampler.UpsamplerPrompts` reads (`t2i`, `i2i`,
`i2i_scaffold`, `t2i_bbox`, `i2i_bbox`, `i2i_bbox_scaffold`, `layout_request`), checks it by reading it back,
and prints the path:

    python3 scripts/upsampler_prompts.py prompts.json
    flux-gen --model flux3-klein --image cat.png --prompt "..." --upsampler-prompts prompts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.text.flux3_upsampler import UpsamplerPrompts

_MARKER = [{"__boxes__": "__boxes__"}]  # stands where the box table goes


def prompts_from_diffusers() -> dict[str, str]:
    """The seven texts, by the keys of our prompts file, from diffusers' FLUX.3 upsampler module."""
    try:
        from diffusers.modular_pipelines.flux3 import prompt_upsampler as source
    except ImportError as e:
        raise SystemExit(
            f"upsampler_prompts.py reads diffusers' FLUX.3 upsampler texts: install diffusers ({e})"
        ) from None
    data = {key: source.SYSTEM_PROMPTS[key] for key in ("t2i", "i2i", "t2i_bbox", "i2i_bbox")}
    data["i2i_scaffold"] = source.I2I_SCAFFOLD[False]
    data["i2i_bbox_scaffold"] = source.I2I_SCAFFOLD[True]
    layout = source.format_layout_request("{prompt}", _MARKER)
    marker = json.dumps(_MARKER, ensure_ascii=False)
    if layout.count(marker) != 1 or "{" in layout.replace("{prompt}", "").replace(marker, ""):
        raise SystemExit(
            "diffusers' layout request is not the shape this script knows; write the file by hand"
        )
    data["layout_request"] = layout.replace(marker, "{boxes}")
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "out", type=Path, help="the JSON file to write (refused if it exists, unless --overwrite)"
    )
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()
    if args.out.exists() and not args.overwrite:
        print(f"{args.out} exists: pass --overwrite to replace it", file=sys.stderr)
        return 1
    tmp = args.out.with_name(args.out.name + ".partial")
    tmp.write_text(json.dumps(prompts_from_diffusers(), ensure_ascii=False, indent=2), encoding="utf-8")
    UpsamplerPrompts.read(tmp)  # the runtime reads it back, or this fails before the file is in place
    tmp.replace(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
