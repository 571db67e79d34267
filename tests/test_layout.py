"""The repository root is on sys.path whenever Python runs from it (`python -m pytest`, `python -m djax`), so a
package there would shadow an installed distribution of the same import name: a root `kernels/` once hid
Hugging Face's `kernels`, which transformers imports."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_root_holds_no_package_but_djax_and_tests():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"djax", "tests"}
