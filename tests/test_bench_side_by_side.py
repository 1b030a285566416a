"""The side-by-side harness loads another revision's packages under new names."""
import subprocess
from pathlib import Path

import pytest

from bench.side_by_side import export_revision, rename_imports

REPO = Path(__file__).resolve().parents[1]


def test_imports_of_the_packages_and_nothing_else_are_renamed():
    src = ("import lsh  # noqa: F401\nfrom lsh.tables import claim\nfrom slide import kernels\n"
           "    from slide.data import read_dataset\nimport slidex\nfrom lshx import y\n"
           "x = 'from lsh import z'\n")
    assert rename_imports(src, "_rev") == (
        "import lsh_rev  # noqa: F401\nfrom lsh_rev.tables import claim\nfrom slide_rev import kernels\n"
        "    from slide_rev.data import read_dataset\nimport slidex\nfrom lshx import y\n"
        "x = 'from lsh import z'\n")


def test_a_revision_exports_as_renamed_packages(tmp_path):
    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    export_revision(REPO, "HEAD", tmp_path / "code")
    step = (tmp_path / "code" / "slide_rev" / "step.py").read_text()
    assert "from slide_rev." in step and "from lsh_rev " in step
    assert "from slide." not in step and "from lsh." not in step and "from lsh " not in step
    assert (tmp_path / "code" / "lsh_rev" / "__init__.py").is_file()
    assert not (tmp_path / "code.partial").exists()
