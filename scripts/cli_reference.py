#!/usr/bin/env python3
"""Write docs/cli.md, the option reference of flux-gen, flux-convert and flux-serve, from the click commands.

Run it after adding or changing an option (tests/cli/test_help.py fails while the page is not current):

    python3 scripts/cli_reference.py            # writes docs/cli.md
    python3 scripts/cli_reference.py --check    # exit 1 if docs/cli.md is not what it would write
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flux_runtime.cli.convert import main as convert_main
from flux_runtime.cli.gen import main as gen_main
from flux_runtime.command_help import reference
from flux_runtime.serve.command import main as serve_main

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"
COMMANDS = (("flux-gen", gen_main), ("flux-convert", convert_main), ("flux-serve", serve_main))


def page() -> str:
    """The text docs/cli.md should hold."""
    return reference(COMMANDS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if the page is stale")
    args = parser.parse_args()
    text = page()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is not current: run python3 scripts/cli_reference.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(PAGE.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
