"""The repository root is on sys.path whenever Python runs from it (`python -m pytest`, `python -m djax`), so a
package there would shadow an installed distribution of the same import name: a root `kernels/` once hid
Hugging Face's `kernels`, which transformers imports."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_root_holds_no_package_but_djax_and_tests():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"djax", "tests"}


def test_installed_kernels_package_is_not_shadowed():
    spec = importlib.util.find_spec("kernels")
    if spec is not None:  # a virtual environment inside the checkout is fine: only ROOT/kernels shadows
        assert Path(spec.origin or "").resolve().parent != ROOT / "kernels", spec.origin
