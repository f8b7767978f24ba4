"""Records nothing can poison (issue 24, item 5).

Every record the runtime reads (the attempt record, stage-in's staged.json, the hooks' pip.json and pre-start.json,
the sync manifest, a download's and an upload's part record, a download's journal) meets the same hostile family:
text that is not JSON, binary junk, a top level that is not an object, a missing field, the wrong type where an int
or a string is wanted (`"x"`, `[1]`, `null`, `true`), `1e400`, an integer of 30 digits, a negative number, fields
that contradict each other, a directory, a FIFO or an oversized file at the path. Each is set aside (renamed beside
itself, kept) with one warning naming the path, what was wrong and the new name, and the record is not used.
"""

import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence, Tuple

import pytest

from ma_runtime import attempt as attempt_module
from ma_runtime import spec as spec_module
from ma_runtime.attempt import Attempt
from ma_runtime.stages import stagein
from ma_runtime.stages.hooks import pip, pre_start
from ma_runtime.stages.hooks.running import Record
from ma_runtime.storage import transfer
from ma_runtime.storage.transfer import journal as journal_module
from ma_runtime.sync.manifest import Manifest
from ma_runtime.util import files, records
from tests.recording import Log
from tests.uploads import upload_file

URL = "obs://bucket/out/"
RAW = "@raw@"  # a string value dumped as the bare JSON number after it (1e400, a 30-digit integer)
SECRET = "s3cr3t-token-value"
Path_ = Tuple[Any, ...]


class Kind:
    """One record: where it lives, a good document, how the runtime loads it, and which fields hold what."""

    def __init__(self, name: str, path: Callable[[Path], Path], good: dict, load: Callable[[Path, Log], bool],
                 ints: Sequence[Path_] = (), non_negative: Sequence[Path_] = (), texts: Sequence[Path_] = (),
                 optional_texts: Sequence[Path_] = (), flags: Sequence[Path_] = (),
                 inconsistent: Sequence[Tuple[str, Path_, Any]] = (),
                 limit: int = files.RECORD_LIMIT):
        self.name, self.path, self.good, self.load = name, path, good, load
        self.ints, self.non_negative, self.texts, self.flags = ints, non_negative, texts, flags
        self.optional_texts = optional_texts
        self.inconsistent, self.limit = inconsistent, limit


def spec_for(tmp_path: Path):
    return spec_module.load({}, {"MA_HOME": str(tmp_path / "home"), "MA_VJ_NAME": "ma-job-1", "VC_TASK_INDEX": "2"})


def load_attempt(path: Path, log: Log) -> bool:
    spec = spec_for(path.parent.parent.parent.parent)
    try:
        return attempt_module.first(spec, "new", log).number == 3  # the good record's attempt 2, continued
    finally:
        attempt_module.release(spec)


def attempt_path(tmp_path: Path) -> Path:
    return attempt_module.record_path(spec_for(tmp_path))


def load_manifest(path: Path, log: Log) -> bool:
    return bool(Manifest.load(path, URL, log).files)


def load_with(validate) -> Callable[[Path, Log], bool]:
    return lambda path, log: records.load(path, validate, log, "a record", then="without it") is not None


def load_journal(path: Path, log: Log) -> bool:
    return bool(journal_module.Journal(path, log).etags)


KINDS = [
    Kind("attempt", attempt_path,
         {"pod": {"vj_name": "ma-job-1", "task_name": "worker", "task_index": 2, "schedule_cnt": 1},
          "attempt": 2, "first": 1, "run_id": "old", "finished": False},
         load_attempt, ints=[("attempt",), ("first",), ("pod", "task_index"), ("pod", "schedule_cnt")],
         non_negative=[("attempt",), ("first",), ("pod", "task_index"), ("pod", "schedule_cnt")],
         texts=[("run_id",), ("pod", "task_name")], flags=[("finished",)],
         inconsistent=[("first-after-attempt", ("first",), 3), ("attempt-zero", ("attempt",), 0),
                       ("first-zero", ("first",), 0), ("extra-field", ("extra",), 1),
                       ("pod-missing-a-field", ("pod",), {"task_name": "worker"})],
         limit=attempt_module._RECORD_LIMIT),
    Kind("staged", lambda tmp: tmp / "state" / "staged.json", {"obs://b/code -> /job/code": "/"},
         lambda path, log: bool(stagein._Record(path, True, log).entries),
         texts=[("obs://b/code -> /job/code",)]),
    Kind("pip", lambda tmp: tmp / "state" / "pip.json",
         {"file": "/code/requirements.txt", "sha256": "ab" * 32, "python": "/usr/bin/python3"},
         lambda path, log: Record(path, True, pip._valid_pip, "w", "t", log).previous is not None,
         texts=[("file",), ("sha256",), ("python",)]),
    Kind("pre-start", lambda tmp: tmp / "state" / "pre-start.json",
         {"file": "/code/ma-pre-start.sh", "sha256": "cd" * 32, "env": {"set": {"TOKEN": SECRET}, "unset": ["OLD"]},
          "services": False},
         lambda path, log: Record(path, True, pre_start._valid_pre_start, "w", "t", log).previous is not None,
         texts=[("file",), ("sha256",), ("env", "set", "TOKEN"), ("env", "unset", 0)], flags=[("services",)],
         inconsistent=[("a-name-with-equals", ("env", "set"), {"A=B": "1"}),
                       ("a-nul-in-a-value", ("env", "set"), {"A": "x\x00y"})]),
    Kind("manifest", lambda tmp: tmp / "state" / "sync" / "m.manifest.json",
         {"version": 1, "url": URL, "files": {"ck/a.bin": [10, 1700000000123456789, 77, "0" * 32, "etag"]}},
         load_manifest, ints=[("files", "ck/a.bin", 0), ("files", "ck/a.bin", 1), ("files", "ck/a.bin", 2)],
         non_negative=[("files", "ck/a.bin", 0), ("files", "ck/a.bin", 2)],
         texts=[("url",)], optional_texts=[("files", "ck/a.bin", 3), ("files", "ck/a.bin", 4)],
         inconsistent=[("a-name-outside", ("files",), {"../a.bin": [1, 2, 3, None, None]}),
                       ("an-absolute-name", ("files",), {"/etc/a": [1, 2, 3, None, None]}),
                       ("a-short-entry", ("files", "ck/a.bin"), [1, 2, 3])]),
    Kind("download", lambda tmp: tmp / "state" / "x.download.json",
         {"url": "obs://b/in/big.bin", "size": 10, "etag": "e", "part_size": 4, "done": [0, 2]},
         load_with(journal_module.valid_download), ints=[("size",), ("part_size",), ("done", 0)],
         non_negative=[("size",), ("part_size",), ("done", 0)], texts=[("url",)],
         inconsistent=[("a-part-past-the-end", ("done", 1), 3), ("part-size-zero", ("part_size",), 0)]),
    Kind("upload", lambda tmp: tmp / "state" / "x.upload.json",
         {"url": "obs://b/out/m.bin", "bucket": "b", "key": "out/m.bin", "path": "/out/m.bin", "size": 20,
          "mtime_ns": 5, "ino": 7, "part_size": 8, "upload_id": "id-1", "parts": {"1": "e1"}, "started": 1.5},
         load_with(journal_module.valid_upload), ints=[("size",), ("mtime_ns",), ("ino",), ("part_size",)],
         non_negative=[("size",), ("ino",), ("part_size",)],
         texts=[("url",), ("bucket",), ("key",), ("path",), ("upload_id",), ("parts", "1")],
         inconsistent=[("a-part-past-the-end", ("parts",), {"4": "e"}), ("a-part-that-is-no-number", ("parts",),
                                                                              {"x": "e"}),
                       ("part-zero", ("parts",), {"0": "e"})]),
]


def dumps(document: Any) -> bytes:
    # RAW-marked strings become the bare JSON numbers they hold, which json.dumps would never write.
    return re.sub(f'"{RAW}([^"]*)"', r"\1", json.dumps(document)).encode()


def changed(document: dict, where: Path_, value: Any) -> dict:
    copied = copy.deepcopy(document)
    target = copied
    for step in where[:-1]:
        target = target[step]
    target[where[-1]] = value
    return copied


def removed(document: dict, where: Path_) -> dict:
    copied = copy.deepcopy(document)
    target = copied
    for step in where[:-1]:
        target = target[step]
    del target[where[-1]]
    return copied


WRONG_FOR_INT = [("str", "x"), ("list", [1]), ("null", None), ("bool", True), ("1e400", RAW + "1e400"),
                 ("30-digits", RAW + "1" + "0" * 29), ("float", 2.5)]
WRONG_FOR_TEXT = [("int", 1), ("list", ["x"]), ("null", None), ("bool", True)]
WRONG_FOR_FLAG = [("str", "false"), ("int", 0), ("null", None)]
WHOLE = [("invalid-json", b'{"attempt": 2,'), ("binary-junk", bytes(range(256)) * 4), ("a-list", b"[1]"),
         ("a-string", b'"x"'), ("a-number", b"3"), ("empty", b""), ("nan", b'{"a": NaN}'),
         ("infinity", b'{"a": Infinity}')]


def cases():
    for kind in KINDS:
        for name, content in WHOLE:
            yield pytest.param(kind, content, id=f"{kind.name}-{name}")
        for where in kind.ints:
            label = ".".join(map(str, where))
            for name, value in WRONG_FOR_INT:
                yield pytest.param(kind, changed(kind.good, where, value), id=f"{kind.name}-{label}-{name}")
        for where in kind.non_negative:
            label = ".".join(map(str, where))
            yield pytest.param(kind, changed(kind.good, where, -1000000), id=f"{kind.name}-{label}-negative")
        for where in kind.texts:
            label = ".".join(map(str, where))
            for name, value in WRONG_FOR_TEXT:
                yield pytest.param(kind, changed(kind.good, where, value), id=f"{kind.name}-{label}-{name}")
        for where in kind.optional_texts:
            label = ".".join(map(str, where))
            for name, value in WRONG_FOR_TEXT:
                if value is not None:
                    yield pytest.param(kind, changed(kind.good, where, value), id=f"{kind.name}-{label}-{name}")
        for where in kind.flags:
            label = ".".join(map(str, where))
            for name, value in WRONG_FOR_FLAG:
                yield pytest.param(kind, changed(kind.good, where, value), id=f"{kind.name}-{label}-{name}")
        for name in kind.good:
            if kind.name != "staged" and name != "started":  # staged.json has no fixed fields; `started` is optional
                yield pytest.param(kind, removed(kind.good, (name,)), id=f"{kind.name}-without-{name}")
        for name, where, value in kind.inconsistent:
            yield pytest.param(kind, changed(kind.good, where, value), id=f"{kind.name}-{name}")
        for special in ("directory", "fifo", "oversized"):
            yield pytest.param(kind, special, id=f"{kind.name}-{special}")


def put(path: Path, content, limit: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "directory":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content == "oversized":
        with open(path, "wb") as sink:
            sink.truncate(limit + 1)  # sparse: refused from its size, never read
    else:
        path.write_bytes(content if isinstance(content, bytes) else dumps(content))


@pytest.mark.parametrize("kind", KINDS, ids=[kind.name for kind in KINDS])
def test_a_good_record_is_used(tmp_path, kind):
    path = kind.path(tmp_path)
    put(path, kind.good, kind.limit)
    log = Log()
    assert kind.load(path, log)
    assert log.fields("record set aside") == []


@pytest.mark.parametrize("kind, content", list(cases()))
def test_a_bad_record_is_set_aside_with_one_warning_and_not_used(tmp_path, kind, content):
    path = kind.path(tmp_path)
    put(path, content, kind.limit)
    before = os.lstat(path)
    log = Log()

    used = kind.load(path, log)

    assert not used
    (warning,) = log.fields("record set aside", "warning")
    assert warning["path"] == str(path) and warning["problem"] and warning["then"]
    kept = Path(warning["kept_as"])
    assert kept.parent == path.parent and kept.name.startswith(f"{path.name}.set-aside-")
    assert not os.path.lexists(path)
    assert os.lstat(kept).st_ino == before.st_ino  # the very thing that was there, kept
    # Nothing a record holds reaches the log but types and field names.
    assert SECRET not in json.dumps(log.records)


def test_the_warning_says_what_was_wrong_in_words(tmp_path):
    kind = KINDS[0]
    path = kind.path(tmp_path)
    problems = []
    for value, expected in [("x", "`first`: an int in 1..2 is wanted, found a str"),
                            (-1000000, "`first`: an int in 1..2 is wanted, found -1000000"),
                            (3, "`first`: an int in 1..2 is wanted, found 3")]:
        put(path, changed(kind.good, ("first",), value), kind.limit)
        log = Log()
        kind.load(path, log)
        problems.append(log.fields("record set aside")[0]["problem"])
        assert problems[-1] == expected
    put(path, changed(kind.good, ("attempt",), RAW + "1" + "0" * 29), kind.limit)
    log = Log()
    kind.load(path, log)
    assert log.fields("record set aside")[0]["problem"] == \
        "`attempt`: an int in 1..999999 is wanted, found an int of 30 digits"
    # The last attempt MA_PROC_START_CNT allows has no next one: a record of it is no record to go on from.
    put(path, changed(kind.good, ("attempt",), 1000000), kind.limit)
    log = Log()
    assert not kind.load(path, log)  # not continued from
    assert log.fields("record set aside")[0]["problem"] == "`attempt`: an int in 1..999999 is wanted, found 1000000"
    # Those set aside in the same second each got a name of their own.
    assert len(list(path.parent.glob(f"{path.name}.set-aside-*"))) == 5


def test_a_torn_journal_line_is_no_damage_but_a_foreign_line_is(tmp_path):
    path = tmp_path / "j.journal"
    path.write_bytes(b'{"key": "a", "etag": "1"}\n{"key": "b", "et\n{"key": "c", "etag": "3"}\n{"key": "d"')
    log = Log()
    assert journal_module.Journal(path, log).etags == {"a": "1", "c": "3"}
    assert log.fields("record set aside") == []

    for line in (b'{"key": 1, "etag": "2"}', b'{"key": "a", "etag": null}', b'["a", "1"]', b"\xff\xfe junk",
                 b'{"key": "a", "etag": "1", "more": 2}', b'{"key": "a", "etag": 1e400}'):
        path.write_bytes(b'{"key": "a", "etag": "1"}\n' + line + b'\n{"key": "c", "etag": "3"}\n')
        log = Log()
        assert journal_module.Journal(path, log).etags == {}, line
        assert len(log.fields("record set aside", "warning")) == 1
        assert not path.exists()


def test_a_journal_key_that_is_not_utf8_is_read_as_written(tmp_path):
    path = tmp_path / "j.journal"
    journal = journal_module.Journal(path, Log())
    journal.add("odd-\udcff-name", "e1")
    journal.close()
    log = Log()
    assert journal_module.Journal(path, log).etags == {"odd-\udcff-name": "e1"}
    assert log.fields("record set aside") == []


def test_a_record_that_cannot_be_renamed_is_still_not_used_and_said_once(tmp_path):
    kind = KINDS[1]  # staged.json
    path = kind.path(tmp_path)
    put(path, b"not json", kind.limit)
    log = Log()
    taken = path.parent / f"{path.name}.set-aside-taken"

    def no_rename(_source, _target):
        raise PermissionError(13, "Permission denied")

    original = os.rename
    os.rename = no_rename
    try:
        assert not kind.load(path, log)
    finally:
        os.rename = original
    (warning,) = log.fields("record set aside", "warning")
    assert warning["kept_as"] == "(not renamed: Permission denied)" and path.exists() and not taken.exists()


def test_no_state_folder_is_no_record(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the state folder should be")
    log = Log()
    assert records.load(blocked / "x.json", lambda document: document, log, "a record", then="-") is None
    assert log.records == []


def test_the_upload_record_that_crashed_a_resume_is_set_aside_and_the_upload_completes(tmp_path):
    """`"parts": {"x": ...}` raised ValueError out of Multipart._resume (int("x")): the upload failed."""
    from ma_runtime.storage import url as storage_url
    from ma_runtime.storage.local import LocalStore

    data = os.urandom(11 << 20)
    source = tmp_path / "model.bin"
    source.write_bytes(data)
    target = tmp_path / "up" / "x"
    target.parent.mkdir()
    options = transfer.TransferOptions(workers=1, part_size=5 << 20, large_threshold=8 << 20, retry_seconds=1,
                                       progress_seconds=0, state_dir=tmp_path / "state")
    url = str(target)
    record = options.state_dir / f"{transfer.name_digest(url, source.absolute())}.upload.json"
    stats = source.stat()
    record.parent.mkdir()
    record.write_text(json.dumps({"url": url, "bucket": "", "key": url, "path": str(source.absolute()),
                                  "size": stats.st_size, "mtime_ns": stats.st_mtime_ns, "ino": stats.st_ino,
                                  "part_size": 5 << 20, "upload_id": "recorded", "parts": {"x": "e"}}))
    log = Log()

    upload_file(LocalStore(), source, storage_url.parse(url), options, log)

    assert target.read_bytes() == data
    (warning,) = log.fields("record set aside", "warning")
    assert warning["path"] == str(record) and "`parts`" in warning["problem"]


# --------------------------------------------------------------------------- item 6: one owner of a pod's record


def holder(path: Path) -> subprocess.Popen:
    """Another process holding the lock (as a runtime beside this one would), until its stdin closes."""
    code = ("import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\n"
            "sys.stdin.read()\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_beside_a_runtime_that_holds_the_record_a_second_runs_unrecorded(tmp_path):
    spec = spec_for(tmp_path)
    attempt_module.record(spec, Attempt(4, "first-runtime", 1))  # the first's, unfinished: it is running
    recorded = attempt_module.record_path(spec).read_bytes()
    other = holder(attempt_module.lock_path(spec))
    log = Log()
    try:
        second = attempt_module.first(spec, "second", log)
        attempt_module.record(spec, second)
        attempt_module.record(spec, second, finished=True)
    finally:
        other.communicate("")
    assert (second.number, second.first, second.recorded) == (1, 1, False)
    (line,) = log.fields(f"attempt not recorded: another runtime in this pod holds the record "
                         f"({attempt_module.lock_path(spec)})", "warning")
    assert line["attempt"] == 1
    assert attempt_module.record_path(spec).read_bytes() == recorded  # neither continued nor finished
    assert "continuing after a runtime that did not finish" not in log.events()


def test_a_nested_runtime_counts_from_its_parents_attempt_and_leaves_the_record_alone(tmp_path):
    spec = spec_module.load({}, {"MA_HOME": str(tmp_path / "home"), "MA_PROC_START_CNT": "3"})
    attempt_module.record(spec, Attempt(3, "outer", 1))
    recorded = attempt_module.record_path(spec).read_bytes()
    log = Log()

    nested = attempt_module.first(spec, "inner", log, environ={"MA_RUNTIME_LINEAGE": "outer"})
    attempt_module.record(spec, nested, finished=True)

    assert (nested.number, nested.first, nested.recorded) == (3, 3, False)
    assert log.events("info") == ["attempt not recorded: this runtime runs inside another (MA_RUNTIME_LINEAGE is "
                                  "set), which counts the attempts"]
    assert attempt_module.record_path(spec).read_bytes() == recorded
    assert not attempt_module.lock_path(spec).exists()  # not even looked at


def test_the_owner_holds_the_lock_for_the_run_and_no_child_inherits_it(tmp_path):
    spec = spec_for(tmp_path)
    owner = attempt_module.first(spec, "run", Log())
    try:
        assert owner.recorded
        assert attempt_module.first(spec, "run", Log()).recorded  # asked again in the same run: still the owner
        (fd,) = [fd for path, fd in attempt_module._owned.items() if path == str(attempt_module.lock_path(spec))]
        import fcntl

        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        probe = subprocess.run([sys.executable, "-c", "import fcntl, os, sys\n"
                                "fd = os.open(sys.argv[1], os.O_RDWR)\n"
                                "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n"
                                "    sys.exit(3)\n", str(attempt_module.lock_path(spec))])
        assert probe.returncode == 3  # held: another process cannot take it
    finally:
        attempt_module.release(spec)
    assert subprocess.run([sys.executable, "-c", "import fcntl, os, sys\n"
                           "fcntl.flock(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
                           str(attempt_module.lock_path(spec))]).returncode == 0


def test_a_state_folder_where_no_lock_can_be_had_keeps_the_record_as_before(tmp_path):
    spec = spec_for(tmp_path)
    attempt_module.record(spec, Attempt(2, "old", 1))
    lock = attempt_module.lock_path(spec)
    lock.mkdir()  # open(O_RDWR) fails: no lock, and no reason to give the record up
    log = Log()
    assert attempt_module.first(spec, "new", log) == Attempt(3, "new", 1)
    assert "continuing after a runtime that did not finish" in log.events("info")



def test_a_child_forked_without_exec_does_not_keep_the_lock(tmp_path):
    """The guard is such a child, and it outlives a SIGKILLed runtime while it sweeps: the next runtime must get
    the record at once, whatever the order of the guard's fork and the lock."""
    spec = spec_for(tmp_path)
    assert attempt_module.first(spec, "run", Log()).recorded
    child = os.fork()
    if child == 0:  # holds whatever the fork gave it, until killed
        time.sleep(30)
        os._exit(0)
    try:
        attempt_module.release(spec)  # the runtime is gone; its forked child lives on
        probe = subprocess.run([sys.executable, "-c", "import fcntl, os, sys\n"
                                "fcntl.flock(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
                                str(attempt_module.lock_path(spec))])
        assert probe.returncode == 0
    finally:
        os.kill(child, 9)
        os.waitpid(child, 0)
