"""Issue 7, security: swapped activations are the user's private data, and no input file can
make ooc run code.

- The swap file, made through the engine's ``storage=`` argument: mode 0600 whatever the
  umask, no name (unlinked while open), inside a fresh 0700 directory of ours.
- A storage directory anyone may write to (without the sticky bit), or a symlink owned by
  another user, is refused before anything is created.
- No ``pickle.load``/``loads``, ``torch.load`` without ``weights_only=True``, ``eval`` or
  ``exec`` anywhere in ooc/, scheduler/ or vmm/, except the allow-listing unpickler; checked
  on the syntax tree (``model.eval()`` is a method, not the builtin) and on the text.
"""

from __future__ import annotations

import ast
import pickle
import os
import re
import stat
from pathlib import Path

import pytest
import torch

from ooc.engine import Options, OutOfCore
from ooc.errors import StorageError
from ooc.storage import private_dir
from test_reliability import ALL, CHUNK, fresh, managed_peak, run_step

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ooc", "scheduler", "vmm")
ALLOWED = {Path("ooc/frag/safe_pickle.py")}   # the allow-listing unpickler


def _engine(storage, **kw) -> tuple[OutOfCore, torch.nn.Module, torch.optim.Optimizer]:
    model, opt = fresh()
    e = OutOfCore(model, opt, budget=managed_peak("adam", ALL) // 4, options=Options(chunk=CHUNK, min_bytes=4096), manage=ALL, storage=str(storage), **kw)
    return e, model, opt


# -- the swap file --------------------------------------------------------------------------


def test_swap_file_is_0600_unlinked_in_a_0700_directory_whatever_the_umask(tmp_path):
    old = os.umask(0)   # the most permissive umask: modes must not depend on it
    try:
        e, model, opt = _engine(tmp_path)
    finally:
        os.umask(old)
    for step in range(2):
        run_step(model, opt, step, e)
    assert e.stats()["bytes_out"] > 0, "the test needs bytes on the tier"
    private = Path(e._mem.tier.directory)
    assert private.parent == tmp_path and private.name.startswith(private_dir.PREFIX)
    st = os.lstat(private)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert os.listdir(private) == [], "the swap file has no name"
    fds = [e._mem.tier._file.fd] + ([e._mem.tier._file.direct_fd] if e._mem.tier._file.direct_fd is not None else [])
    for fd in fds:
        fst = os.fstat(fd)
        assert stat.S_ISREG(fst.st_mode) and stat.S_IMODE(fst.st_mode) == 0o600, oct(fst.st_mode)
        assert fst.st_nlink == 0, "unlinked while open"
        assert fst.st_uid == os.geteuid()
        assert fst.st_size > 0
        assert os.readlink(f"/proc/self/fd/{fd}").endswith("(deleted)")
        assert os.get_inheritable(fd) is False, "not leaked to child processes"
    e.close()
    assert os.listdir(tmp_path) == []


# -- unsafe storage directories ---------------------------------------------------------------


def _refused(storage, words: str) -> None:
    model, opt = fresh()
    before = set(os.listdir(os.path.dirname(os.path.abspath(storage))))
    with pytest.raises(StorageError, match=words):
        OutOfCore(model, opt, budget="1MiB", options=Options(chunk=CHUNK), storage=str(storage))
    assert set(os.listdir(os.path.dirname(os.path.abspath(storage)))) == before


def test_world_writable_storage_without_sticky_bit_is_refused(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    os.chmod(d, 0o777)
    _refused(d, "world-writable without the sticky bit")
    assert os.listdir(d) == [], "nothing was created in it"
    os.chmod(d, 0o1777)   # like /tmp: allowed (nobody can rename our directory away)
    e, _, _ = _engine(d)
    e.close()
    assert os.listdir(d) == []


def test_symlink_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    e, _, _ = _engine(link)   # our own symlink is followed
    e.close()
    if os.geteuid() == 0:
        os.lchown(link, 12345, 12345)   # as root we can make it someone else's
    else:   # pragma: no cover - as a user: pretend our own uid is not trusted
        monkeypatch.setattr(private_dir, "_trusted_uids", lambda: {0})
    _refused(link, "symlink owned by uid")
    assert os.listdir(target) == []


@pytest.mark.parametrize("what", ["missing", "file", "dangling"])
def test_other_unusable_storage_paths_are_refused(tmp_path, what):
    path = tmp_path / what
    if what == "file":
        path.write_text("not a directory")
    elif what == "dangling":
        path.symlink_to(tmp_path / "nowhere")
    _refused(path, {"missing": "does not exist", "file": "not a directory", "dangling": "dangling"}[what])


# -- no code from input files --------------------------------------------------------------------


def _violations(source: str) -> list[str]:
    """Calls that could run code or unpickle from a file, found on the syntax tree."""
    out = []
    tree = ast.parse(source)
    pickle_names = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in pickle_names:
            for alias in node.names:
                if alias.name in ("load", "loads", "Unpickler", "_Unpickler", "open"):
                    out.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("eval", "exec", "__import__"):
            out.append(f"line {node.lineno}: {f.id}()")
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
            mod, attr = f.value.id, f.attr
            if mod in pickle_names and attr in ("load", "loads", "Unpickler", "_Unpickler", "open"):
                out.append(f"line {node.lineno}: {mod}.{attr}()")
            if mod == "torch" and attr == "load":
                weights_only = [k for k in node.keywords if k.arg == "weights_only"]
                if not (weights_only and isinstance(weights_only[0].value, ast.Constant)
                        and weights_only[0].value.value is True):
                    out.append(f"line {node.lineno}: torch.load() without weights_only=True")
            if mod in ("np", "numpy") and attr == "load":
                allow = [k for k in node.keywords if k.arg == "allow_pickle"]
                if allow and not (isinstance(allow[0].value, ast.Constant) and allow[0].value.value is False):
                    out.append(f"line {node.lineno}: numpy.load(allow_pickle=...)")
            if mod == "yaml" and attr in ("load", "unsafe_load", "full_load"):
                out.append(f"line {node.lineno}: yaml.{attr}()")
    return out


_TEXT = re.compile(r"\bpickle\.loads?\b|\btorch\.load\((?![^)]*weights_only=True)|(?<![\w.])eval\(|"
                   r"(?<![\w.])exec\(|\bUnpickler\b")


def test_the_checker_finds_what_it_should_and_nothing_else():
    bad = ["pickle.load(f)", "x = pickle.loads(b)", "from pickle import loads", "torch.load(p)",
           "torch.load(p, weights_only=False)", "eval(s)", "exec(code)", "np.load(p, allow_pickle=True)",
           "cPickle.load(f)", "yaml.load(s)", "__import__('os')"]
    for src in bad:
        assert _violations(src), src
    good = ["model.eval()", "torch.load(p, weights_only=True)", "pickle.dumps(x)", "json.loads(s)",
            "self.exec_plan()", "np.load(p)", "evaluate(x)"]
    for src in good:
        assert not _violations(src), src


def test_no_unsafe_deserialization_or_eval_in_the_source_tree():
    hits = []
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 30
    for path in files:
        rel = path.relative_to(ROOT)
        if rel in ALLOWED:
            continue
        source = path.read_text(encoding="utf-8")
        hits += [f"{rel}: {v}" for v in _violations(source)]
        for n, line in enumerate(source.splitlines(), 1):   # the same, on the text
            code = line.split("#", 1)[0]
            if _TEXT.search(code) and not re.search(r"""["'].*(eval|exec|pickle|Unpickler).*["']""", code):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, "unsafe loading or eval outside ooc/frag/safe_pickle.py:\n" + "\n".join(hits)


def test_the_allow_listing_unpickler_is_what_the_snapshot_loader_uses():
    source = (ROOT / "ooc/frag/snapshot_input.py").read_text()   # the snapshot reader
    assert "safe_load(" in source and not _violations(source)
    from ooc.frag import safe_pickle
    assert issubclass(safe_pickle.SafeUnpickler, pickle._Unpickler)
    assert safe_pickle.ALLOWED_GLOBALS <= {("builtins", "set"), ("builtins", "frozenset"),
                                           ("__builtin__", "set"), ("__builtin__", "frozenset")}
