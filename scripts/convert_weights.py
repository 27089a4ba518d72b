#!/usr/bin/env python3
"""Convert FLUX.1 transformer or VAE weights between the BFL and diffusers layouts.

The same command as the installed `flux-convert` (see `flux-convert --help`), for a checkout
without the package installed as a script:

    python scripts/convert_weights.py transformer flux1-dev.safetensors out/transformer
    python scripts/convert_weights.py vae path/to/FLUX.1-dev/vae out/ae.safetensors
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from flux_runtime.cli.convert import main

    main(prog_name="convert_weights.py")
