"""A model's own pipeline class, loaded from its folder (or an installed package) by its spec.

Code is only ever loaded from the model repository the operator configured, or from a
package installed in the server's environment, never from a request: it runs with the
server's privileges. Each model's folder is imported as a package of its own
(``tensorgate_models.<model>``), so two models may both have a ``pipeline.py``, relative imports
between a model's modules work, and a reload imports the files afresh.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import re
import sys
import traceback
from pathlib import Path
from types import CodeType, ModuleType

from preprocessing.pipeline import Pipeline
from preprocessing.spec import PythonSpec
from service.errors import ModelLoadError

log = logging.getLogger("tensorgate.loader")

ROOT_PACKAGE = "tensorgate_models"


def load_pipeline(spec: PythonSpec, folder: Path, model: str) -> Pipeline:
    """``spec.cls(**spec.params)`` from ``folder`` (the model's folder, beside config.yaml) or
    from the installed package; ModelLoadError (one line, the traceback in the log) when it
    cannot be imported or built, or is not a :class:`~preprocessing.pipeline.Pipeline`."""
    try:
        module = _import(spec, folder, model)
        cls = getattr(module, spec.cls, None)
        if cls is None:
            raise ModelLoadError(f"preprocessing: {spec.module} has no class '{spec.cls}'")
        if not (isinstance(cls, type) and issubclass(cls, Pipeline)):
            raise ModelLoadError(
                f"preprocessing: {spec.module}.{spec.cls} is not a subclass of "
                "preprocessing.pipeline.Pipeline"
            )
        pipeline = cls(**spec.params)
    except ModelLoadError:
        raise
    except Exception as exc:
        log.error(
            "model %s: its preprocessing code failed to load:\n%s",
            model,
            "".join(traceback.format_exception(exc)),
        )
        where = last_frame(exc)
        said = " ".join(str(exc).split())  # one line in the metadata, whatever the code raised
        raise ModelLoadError(
            f"preprocessing code {spec.module}.{spec.cls} failed to load: "
            f"{type(exc).__name__}: {said}{where}{_relative_hint(exc, folder)} (traceback logged)"
        ) from None
    return pipeline


def _import(spec: PythonSpec, folder: Path, model: str) -> ModuleType:
    if spec.package is not None:
        distribution, _, version = spec.package.partition("==")
        try:
            installed = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            raise ModelLoadError(
                f"preprocessing.package {spec.package}: {distribution} is not installed"
            ) from None
        if version and installed != version:
            raise ModelLoadError(
                f"preprocessing.package {spec.package}: {distribution} {installed} is installed"
            )
        return importlib.import_module(spec.module)
    path = folder / f"{spec.module.replace('.', '/')}.py"
    if not path.is_file():
        raise ModelLoadError(f"preprocessing.module '{spec.module}': {path} does not exist")
    package = f"{ROOT_PACKAGE}.{package_name(model)}"
    _fresh_package(package, folder)
    return importlib.import_module(f"{package}.{spec.module}")


def package_name(model: str) -> str:
    """The package a model's folder is imported as: its name, with each character that is not
    a letter or digit written as ``_`` and its code point, so that no two model names share
    one (``lz-x`` and ``lz_x`` were both ``lz_x``, and one model's lazy imports ran the other's
    modules)."""
    return re.sub(r"[^0-9A-Za-z]", lambda m: f"_{ord(m.group()):x}", model)


def _fresh_package(name: str, folder: Path) -> None:
    """``name`` as a package over ``folder``, its previously imported modules dropped (a
    reload after the files changed imports them again)."""
    if ROOT_PACKAGE not in sys.modules:
        root = ModuleType(ROOT_PACKAGE)
        root.__path__ = []
        sys.modules[ROOT_PACKAGE] = root
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[loaded]
    # Sources only, never a cached .pyc: a one-byte edit within the same second (same size,
    # same mtime) would otherwise import the old code's bytecode.
    sys.path_importer_cache[str(folder)] = importlib.machinery.FileFinder(
        str(folder), (_SourceOnly, importlib.machinery.SOURCE_SUFFIXES)
    )
    spec = importlib.util.spec_from_loader(name, loader=None, is_package=True)
    assert spec is not None
    spec.submodule_search_locations = [str(folder)]
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(folder)]
    sys.modules[name] = package
    importlib.invalidate_caches()


class _SourceOnly(importlib.machinery.SourceFileLoader):
    """Compiles the source each time and writes no bytecode."""

    def get_code(self, fullname: str) -> CodeType:
        return compile(self.get_data(self.path), self.path, "exec", dont_inherit=True)


def _relative_hint(exc: BaseException, folder: Path) -> str:
    """For ``import feats`` of a module beside the code: how to import it (the model's folder
    is a package of its own, never on ``sys.path``)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    local = folder / exc.name.replace(".", "/")
    if not (local.with_suffix(".py").is_file() or (local / "__init__.py").is_file()):
        return ""
    return f"; {exc.name} is the model's own: import it relatively (from .{exc.name} import ...)"


def last_frame(exc: BaseException) -> str:
    """`` at pipeline.py:12`` for the innermost frame of the model's own code (or of whatever
    raised, in a module not of importlib), if any."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if f.filename.endswith(".py") and "importlib" not in f.filename]
    if not own:
        return ""
    return f" at {Path(own[-1].filename).name}:{own[-1].lineno}"
