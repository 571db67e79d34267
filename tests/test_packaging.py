"""pyproject's package list and package data against the tree: a wheel (a non-editable install) must carry every
module, the embedded models and the sources built on use, or `djax generate` and the kernels fail only there."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _folder(package: str) -> Path:
    return ROOT.joinpath(*package.split("."))


def test_every_folder_of_modules_is_a_listed_package():
    listed = set(_setuptools()["packages"])
    with_modules = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "djax").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert with_modules, "no modules found under djax/"
    assert with_modules <= listed, f"not in [tool.setuptools] packages: {sorted(with_modules - listed)}"
    missing = [p for p in listed if not _folder(p).is_dir()]
    assert not missing, f"listed packages with no folder: {missing}"


def test_package_data_covers_the_models_and_the_sources_built_on_use():
    data = _setuptools()["package-data"]
    covered = {f for package, globs in data.items() for g in globs for f in _folder(package).glob(g)}
    needed = [
        *(ROOT / "djax" / "assets").glob("*/config.json"),
        *(ROOT / "djax" / "assets").glob("*/model.safetensors"),
        *(ROOT / "djax" / "assets").glob("*/tokenizer.json"),
        *(ROOT / "djax" / "ffi" / "csrc").iterdir(),
        *(ROOT / "djax" / "kernels").glob("*.cu"),
    ]
    assert len(needed) >= 8, "the embedded models or the launcher sources are missing from the tree"
    uncovered = sorted(str(p.relative_to(ROOT)) for p in needed if p not in covered)
    assert not uncovered, f"not in [tool.setuptools.package-data]: {uncovered}"
    # each data file's package is a listed package: setuptools installs data only beside a listed package
    assert set(data) <= set(_setuptools()["packages"])
