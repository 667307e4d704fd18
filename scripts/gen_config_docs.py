"""Write docs/config.md from the config declarations (tests/unit/test_config_docs.py checks it is up to date).

    python scripts/gen_config_docs.py           # from the repository root
"""

from pathlib import Path

from meshrl.trainer.config_reference import config_reference

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    out.write_text(config_reference(markdown=True))
    print(f"wrote {out}")
