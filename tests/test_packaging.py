"""What an installed package gives its users beyond the engine: the adapters ship in the
base wheel, so without their framework they must say which extra to install, and each
package is marked typed (PEP 561) so type checkers read its annotations."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys

import pytest


@pytest.mark.parametrize("adapter, framework, extra", [
    ("langchain_mlx_tandem", "langchain_core", "mlx-tandem[langchain]"),
    ("llama_index.llms.mlx_tandem", "llama_index.core", "mlx-tandem[llama-index]"),
])
def test_an_adapter_without_its_framework_names_the_extra_to_install(adapter, framework, extra):
    # sys.modules[name] = None makes every import of that module fail, as if not installed.
    code = (f"import sys; sys.modules[{framework!r}] = None\n"
            f"try:\n    import {adapter}\nexcept ImportError as exc:\n    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f'pip install "{extra}"' in proc.stdout


@pytest.mark.parametrize("package", ["mlx_tandem", "langchain_mlx_tandem", "llama_index.llms.mlx_tandem"])
def test_each_package_is_marked_typed(package):
    assert importlib.resources.files(package).joinpath("py.typed").is_file()
