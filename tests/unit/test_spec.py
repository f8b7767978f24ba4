"""JobSpec: precedence, defaults, and every bad input as one line with exit code 78."""

import json
import os
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.errors import ConfigError
from tests.conftest import run_ma


def write_job(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_is_flags_then_env_then_file_then_defaults(tmp_path):
    job = write_job(tmp_path, "num_gpus: 2\nnum_hosts: 3\ntask_name: learner\n")
    env = {"MA_HOME": str(tmp_path), "MA_NUM_GPUS": "4", "MA_NUM_HOSTS": "5"}
    resolved = spec.load({"num_gpus": "8"}, env, job)
    assert (resolved.num_gpus, resolved.sources["num_gpus"]) == (8, "flag")
    assert (resolved.num_hosts, resolved.sources["num_hosts"]) == (5, "env")
    assert (resolved.task_name, resolved.sources["task_name"]) == ("learner", "file")
    assert (resolved.task_index, resolved.sources["task_index"]) == (0, "default")


def test_paths_derive_from_ma_home_unless_set(tmp_path):
    resolved = spec.load({}, {"MA_HOME": str(tmp_path), "MA_LOG_DIR": str(tmp_path / "logs")})
    assert resolved.mount_path == tmp_path / "modelarts"
    assert resolved.job_dir == tmp_path / "modelarts" / "user-job-dir"
    assert resolved.log_dir == tmp_path / "logs"


def test_laptop_fallback_when_platform_home_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(spec, "PLATFORM_HOME", tmp_path / "no-such-home")
    monkeypatch.setenv("HOME", str(tmp_path))
    resolved = spec.load({}, {})
    assert resolved.ma_home == tmp_path / ".ma-runtime"
    assert any("using" in note and ".ma-runtime" in note for note in resolved.notes)


def test_empty_variable_counts_as_unset(tmp_path):
    assert spec.load({}, {"MA_HOME": str(tmp_path), "MA_NUM_GPUS": ""}).num_gpus == 0


@pytest.mark.parametrize(
    "vj_name, stem",
    [
        ("ma-job-95f6", "modelarts-job-95f6-worker-0"),
        ("modelarts-job-95f6", "modelarts-job-95f6-worker-0"),
        (None, "modelarts-job-local-worker-0"),
        ("custom", "modelarts-job-custom-worker-0"),
    ],
)
def test_task_log_name_follows_the_platform(tmp_path, vj_name, stem):
    env = {"MA_HOME": str(tmp_path)}
    if vj_name:
        env["MA_VJ_NAME"] = vj_name
    assert spec.load({}, env).task_log_path == tmp_path / "modelarts" / "log" / f"{stem}.log"


def test_task_log_name_uses_task_name_and_index(tmp_path):
    env = {"MA_HOME": str(tmp_path), "MA_VJ_NAME": "ma-job-1", "MA_TASK_NAME": "learner", "VC_TASK_INDEX": "3"}
    assert spec.load({}, env).task_log_path.name == "modelarts-job-1-learner-3.log"


def test_hyperparameters_keep_order_and_render_booleans(tmp_path):
    job = write_job(tmp_path, "hyperparameters:\n  lr: 0.01\n  use_amp: true\n  name: a b\n")
    resolved = spec.load({}, {"MA_HOME": str(tmp_path)}, job)
    assert resolved.hyperparameters == (("lr", "0.01"), ("use_amp", "True"), ("name", "a b"))


@pytest.mark.parametrize(
    "env, text, expected",
    [
        ({"MA_NUM_GPUS": "abc"}, None, "MA_NUM_GPUS='abc' is not a whole number"),
        ({"VC_TASK_INDEX": "-1"}, None, "VC_TASK_INDEX='-1' must be between 0 and 99999"),
        ({"MA_NUM_HOSTS": "0"}, None, "MA_NUM_HOSTS='0' must be between 1 and 100000"),
        ({"MA_RUNTIME_STOP_GRACE_SECONDS": "soon"}, None, "MA_RUNTIME_STOP_GRACE_SECONDS='soon' is not a number"),
        ({"MA_RUNTIME_LOG_FORMAT": "xml"}, None, "MA_RUNTIME_LOG_FORMAT='xml' must be one of logfmt, json"),
        ({"MA_VJ_NAME": "a/b"}, None, "MA_VJ_NAME='a/b' is not a valid Volcano job name"),
        ({"MA_RUNTIME_COORDINATOR": "zk://h:1"}, None,
         "MA_RUNTIME_COORDINATOR='zk://h:1' is not a valid auto, off or etcd://host:port[,...]"),
        # No user or password in the URL: the store holds no secret, and a URL cannot bring one in.
        ({"MA_RUNTIME_COORDINATOR": "etcd://user:pw@h:2379"}, None, "is not a valid auto, off or etcd://"),
        ({"MA_RUNTIME_COORDINATOR_PORT": "0"}, None, "MA_RUNTIME_COORDINATOR_PORT='0' must be between 1 and 65535"),
        ({"MA_RUNTIME_BARRIER_SECONDS": "0.5"}, None,
         "MA_RUNTIME_BARRIER_SECONDS='0.5' must be a number between 1 and"),
        ({"MA_RUNTIME_NODE_LOST_SECONDS": "1"}, None,
         "MA_RUNTIME_NODE_LOST_SECONDS='1' must be a number between 2 and 3600"),
        ({}, "num_gpus: [1, 2\n", "YAML syntax error at line 2"),
        ({}, "num_gpu: 1\n", "unknown key 'num_gpu'"),
        ({}, "num_gpu: 1\n", "did you mean 'num_gpus'?"),
        ({}, "preflight: {shm_min_g: 1}\n", "did you mean 'preflight.shm_min_gb'?"),
        ({}, "num_gpu: 1\n", "(docs/reference/settings.md lists every key)"),
        ({}, "zzzz: 1\n", "hint=\"docs/reference/settings.md lists every key\""),
        ({}, "- a\n- b\n", "the top level must be a mapping"),
        ({}, "num_gpus: abc\n", "job file key 'num_gpus'='abc' is not a whole number"),
        ({}, "num_gpus: {a: 1}\n", "job file key 'num_gpus': expected a single number or string"),
        ({}, "hyperparameters: [1]\n", "'hyperparameters' must be a mapping"),
        ({}, "hyperparameters: {'bad name': 1}\n", "hyperparameters.bad name"),
        ({}, "hyperparameters: {lr: null}\n", "hyperparameters.lr"),
    ],
)
def test_bad_input_is_one_clear_line_with_exit_code_78(tmp_path, job_env, env, text, expected):
    job_env.update(env)
    args = ["--config", write_job(tmp_path, text)] if text is not None else []
    result = run_ma([*args, "true"], job_env)
    assert result.returncode == 78
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected in lines[0]
    assert "error,exiting" in lines[0]
    assert "Traceback" not in result.stderr


def test_missing_job_file_and_unwritable_log_dir(tmp_path, job_env):
    missing = run_ma(["--config", str(tmp_path / "nope.yaml"), "true"], job_env)
    assert missing.returncode == 78 and "no such job file" in missing.stderr
    blocker = tmp_path / "file"
    blocker.write_text("")
    job_env["MA_LOG_DIR"] = str(blocker / "log")
    unwritable = run_ma(["true"], job_env)
    assert unwritable.returncode == 78 and "cannot write the task log" in unwritable.stderr
    assert "Traceback" not in unwritable.stderr


def test_config_file_from_environment(tmp_path, job_env):
    job_env["MA_RUNTIME_CONFIG"] = write_job(tmp_path, "num_gpus: 6\n")
    printed = json.loads(run_ma(["--print-config"], job_env).stdout)
    assert printed["settings"]["num_gpus"] == 6 and printed["sources"]["num_gpus"] == "file"


def test_print_config_shows_resolved_values_with_sources(tmp_path, job_env):
    job_env["MA_NUM_GPUS"] = "4"
    result = run_ma(["--print-config", "--task-index", "2", "python", "train.py"], job_env)
    assert result.returncode == 0
    printed = json.loads(result.stdout)
    assert printed["settings"]["num_gpus"] == 4 and printed["sources"]["num_gpus"] == "env"
    assert printed["settings"]["task_index"] == 2 and printed["sources"]["task_index"] == "flag"
    assert printed["argv"] == ["python", "train.py"]
    assert printed["task_log"].endswith("modelarts-job-local-worker-2.log")
    assert not Path(printed["task_log"]).exists(), "--print-config must not start anything"


def test_print_config_masks_secrets(tmp_path, job_env):
    job_env["OBS_SECRET_ACCESS_KEY"] = "s3cr3t-value-from-env"
    job = write_job(tmp_path, "hyperparameters:\n  db_password: hunter2hunter2\n  lr: 0.1\n")
    result = run_ma(
        ["--config", job, "--print-config", "--", "python", "t.py", "--api-token=tok-123456", "s3cr3t-value-from-env"],
        job_env,
    )
    assert result.returncode == 0
    for secret in ("hunter2hunter2", "tok-123456", "s3cr3t-value-from-env"):
        assert secret not in result.stdout
    printed = json.loads(result.stdout)
    assert printed["hyperparameters"] == {"db_password": "******", "lr": "0.1"}


def test_load_raises_config_error_not_exit(tmp_path):
    with pytest.raises(ConfigError) as caught:
        spec.load({"num_gpus": "x"}, {"MA_HOME": str(tmp_path)})
    assert "--num-gpus='x'" in caught.value.reason


# --- hardening: numbers have ranges, job files have bounds (issue 10, items 10 and 16) ---------------------


@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("MA_TORCHRUN_MASTER_PORT", "99999999", "must be between 1 and 65535"),
        ("MA_RUNTIME_MSRUN_MASTER_PORT", "0", "must be between 1 and 65535"),
        ("MA_RUNTIME_RANKTABLE_TIMEOUT", "1e308", "must be a number between 0 and 604800"),
        ("MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS", "nan", "must be a number between 0 and 604800"),
        ("MA_RUNTIME_STOP_GRACE_SECONDS", "inf", "must be a number between 0 and 604800"),
        ("MA_RUNTIME_STORAGE_RETRY_SECONDS", "-1", "must be a number between 0 and 604800"),
        ("MA_RUNTIME_STORAGE_WORKERS", "100000", "must be between 1 and 256"),
        ("MA_NUM_GPUS", "9" * 5000, "is not a whole number (expected 0 to 1024)"),
        ("MA_NUM_GPUS", "1e3", "is not a whole number"),
        ("MSRUN_CLUSTER_TIME_OUT", "99999999999", "must be between 1 and 604800"),
        ("MA_RUNTIME_NPROC_PER_NODE", "0", "must be between 1 and 1024"),
    ],
)
def test_every_number_has_a_documented_range(tmp_path, name, value, expected):
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path), name: value})
    assert expected in caught.value.reason
    assert name in caught.value.reason


def test_every_numeric_setting_declares_its_range():
    # The README's range column is generated from the same bounds: a number without one is a gap.
    for setting in spec.SETTINGS:
        if getattr(setting.parse, "range", None) is None:
            assert setting.parse not in (int, float), setting.name
    numeric = [s for s in spec.SETTINGS if getattr(s.parse, "range", None)]
    assert len(numeric) >= 25


def test_a_huge_bad_value_is_quoted_short_and_rejected_at_once(tmp_path):
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path), "MA_NUM_GPUS": "x" * 30_000})
    assert "(30000 characters)" in caught.value.reason
    assert len(caught.value.reason) < 300


BOMB = """\
a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]
f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]
g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]
h: &h [*g, *g, *g, *g, *g, *g, *g, *g, *g]
preflight: {checks: [*h, *h, *h, *h, *h, *h, *h, *h, *h]}
"""


@pytest.mark.parametrize(
    "text, expected",
    [
        (BOMB, "expands to more than 100000 values"),
        ("hyperparameters: " + "[" * 40 + "1" + "]" * 40 + "\n", "nested deeper than 32 levels"),
        ("1: 2\n", "the key '1' is not a string (int)"),
        ("true: 2\n", "the key 'true' is not a string (bool)"),
        ("~: 2\n", "is not a string (null)"),
        ("hyperparameters:\n  1: 0.5\n", "line 2: the key '1' is not a string"),
        ("num_gpus: 1\n" + "#" * (1 << 20) + "\n", "is over 1 MiB: not a job file"),
    ],
)
def test_hostile_job_files_are_refused_in_one_line(tmp_path, text, expected):
    path = write_job(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path)}, path)
    assert expected in caught.value.reason


def test_an_alias_within_bounds_still_works(tmp_path):
    path = write_job(tmp_path, "preflight:\n  checks: &c [dns, disk-size]\n  warn_only: *c\n")
    resolved = spec.load({}, {"MA_HOME": str(tmp_path)}, path)
    assert resolved.preflight_warn_only == ("dns", "disk-size")


def test_job_file_that_is_not_utf8_or_not_a_file(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"task_name: caf\xe9\n")
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path)}, str(latin))
    assert "not UTF-8 text" in caught.value.reason
    for special, kind in (("/dev/zero", "a character device"), (str(tmp_path), "a directory")):
        with pytest.raises(ConfigError) as caught:
            spec.load({}, {"MA_HOME": str(tmp_path)}, special)
        assert f"is {kind}, not a job file" in caught.value.reason
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as caught:  # refused without opening: a FIFO would block the read
        spec.load({}, {"MA_HOME": str(tmp_path)}, str(fifo))
    assert "is a FIFO, not a job file" in caught.value.reason


def test_hostile_job_file_end_to_end_is_one_line_78(tmp_path, job_env):
    result = run_ma(["--config", write_job(tmp_path, BOMB), "true"], job_env, timeout=30)
    assert result.returncode == 78
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "expands to more than" in result.stderr


def test_the_hint_names_the_variable_and_what_it_holds(tmp_path):
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path), "VC_TASK_INDEX": "-1"})
    assert caught.value.hint == "VC_TASK_INDEX: this container's index in the job"  # was "is the this container's"


# --------------------------------------------------------------------------- one declaration per setting


@pytest.mark.parametrize("variable", ["MA_TASK_INDEX", "VK_TASK_INDEX"])
def test_the_task_index_fallbacks_are_read_by_spec_as_by_the_rank_table(tmp_path, variable):
    # spec read only VC_TASK_INDEX (0 here) while the rank table's node view also read these: two rules, two answers.
    loaded = spec.load({}, {"MA_HOME": str(tmp_path), variable: "3"})
    assert (loaded.task_index, loaded.sources["task_index"]) == (3, "env")


def test_vc_task_index_wins_over_its_fallbacks_and_a_bad_fallback_is_named(tmp_path):
    both = {"MA_HOME": str(tmp_path), "VC_TASK_INDEX": "1", "MA_TASK_INDEX": "2", "VK_TASK_INDEX": "3"}
    assert spec.load({}, both).task_index == 1
    assert spec.load({}, {**both, "VC_TASK_INDEX": ""}).task_index == 2  # empty counts as unset
    with pytest.raises(ConfigError, match=r"^MA_TASK_INDEX='x' is not a whole number"):
        spec.load({}, {"MA_HOME": str(tmp_path), "MA_TASK_INDEX": "x"})
    assert spec.value_from("task_index", {"VK_TASK_INDEX": "4"}) == 4
    assert spec.value_from("task_index", {}) is None


def test_the_jobspec_fields_are_the_settings_rows_and_their_types(tmp_path):
    import dataclasses
    from typing import Optional, Tuple

    fields = {field.name: field.type for field in dataclasses.fields(spec.JobSpec)}
    assert list(fields)[:len(spec.SETTINGS)] == [setting.name for setting in spec.SETTINGS]
    assert list(fields)[len(spec.SETTINGS):] == ["hyperparameters", "inputs", "outputs", "config_file", "sources",
                                                 "notes"]
    assert (fields["task_index"], fields["ma_home"], fields["log_dir"]) == (int, Path, Path)
    assert (fields["nproc_per_node"], fields["mpi_slots"]) == (Optional[int], Optional[int])
    assert (fields["preflight_checks"], fields["hang_stacks"]) == (Tuple[str, ...], bool)
    assert spec.JobSpec.__module__ == "ma_runtime.spec" and spec.JobSpec.__name__ == "JobSpec"
    loaded = spec.load({}, {"MA_HOME": str(tmp_path)})
    assert all(isinstance(getattr(loaded, name), kind) for name, kind in fields.items()
               if kind in (int, float, bool, str, Path))


def test_every_row_says_its_variable_key_flag_kind_and_owner():
    for setting in spec.SETTINGS:
        assert setting.envs[0] == setting.env and setting.flag == "--" + setting.name.replace("_", "-")
        assert setting.file_key.replace(".", "_") == setting.name and setting.kind
        assert setting.owner == "spec" or setting.owner.startswith("ma_runtime.launch.")
    by_name = spec.SETTINGS_BY_NAME
    assert by_name["preflight_checks"].file_key == "preflight.checks"
    assert by_name["num_gpus"].kind == "whole number, 0 to 1024" and by_name["num_gpus"].range == (0, 1024)
    assert by_name["sshd_port"].kind == "port, 1 to 65535" and by_name["hang_stacks"].type is bool


def test_each_launchers_settings_are_declared_in_its_module_and_collected():
    from ma_runtime.launch import registry

    for method in registry.METHODS:
        module = registry.launcher(method)
        for setting in getattr(module, "SETTINGS", ()):
            assert spec.SETTINGS_BY_NAME[setting.name] is setting and setting.owner == module.__name__
    owners = {setting.name: setting.owner for setting in spec.SETTINGS}
    assert owners["torchrun_master_port"] == "ma_runtime.launch.torchrun"
    assert owners["msrun_master_port"] == "ma_runtime.launch.msrun"
    assert owners["sshd_port"] == owners["mpi_slots"] == "ma_runtime.launch.mpirun"
    assert owners["init_method_port"] == "ma_runtime.launch.pytorch_gpu"


@pytest.mark.parametrize("first", ["ma_runtime.launch.mpirun", "ma_runtime.launch.torchrun", "ma_runtime.setting",
                                   "ma_runtime.spec.jobfile", "ma_runtime.stages.ranktable"])
def test_any_module_may_be_imported_first(first):
    # The launchers declare rows that spec collects through the registry: no import order may break the cycle.
    import subprocess
    import sys

    code = f"import {first}; import ma_runtime.spec as s; assert s.SETTINGS_BY_NAME['sshd_port'].default == 36666"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_exported_settings_reach_the_command_under_their_variables(tmp_path):
    from ma_runtime.spec.table import EXPORTED
    from ma_runtime.supervise.attempt_processes import worker_env

    loaded = spec.load({"task_index": "2"}, {"MA_HOME": str(tmp_path), "MA_RUNTIME_PROGRESS_FILE": "/p",
                                             "MA_VJ_NAME": "ma-job-1", "MA_PROC_START_CNT": "9"})
    env = worker_env(loaded, "run-1", 3, {"MA_PROC_START_CNT": "9"})
    assert {setting.env for setting in EXPORTED} >= {"MA_HOME", "VC_TASK_INDEX", "MA_RUNTIME_PROGRESS_FILE"}
    assert all(env[setting.env] == str(getattr(loaded, setting.name)) for setting in EXPORTED)
    assert (env["VC_TASK_INDEX"], env["MA_PROC_START_CNT"], env["MA_SCHEDULE_CNT"]) == ("2", "3", "1")


# --- issue 29, item 9: many hyperparameters are checked in one pass, and a bad one among them is still named ------

MANY = 20_000


def many_hyperparameters(bad_line: str = "", at: int = MANY // 2) -> str:
    lines = [f"  hp_{i}: {i / 2}\n" for i in range(MANY)]
    if bad_line:
        lines[at] = bad_line
    return "hyperparameters:\n" + "".join(lines)


def test_many_hyperparameters_are_read_in_order(tmp_path):
    resolved = spec.load({}, {"MA_HOME": str(tmp_path)}, write_job(tmp_path, many_hyperparameters()))
    assert resolved.hyperparameters == tuple((f"hp_{i}", str(i / 2)) for i in range(MANY))


@pytest.mark.parametrize(
    "bad_line, expected",
    [
        ("  'bad name': 1\n", "'hyperparameters.bad name': a name must be 1-64 characters"),
        ("  " + "n" * 65 + ": 1\n", f"'hyperparameters.{'n' * 65}': a name must be"),
        ("  hp_x: null\n", "'hyperparameters.hp_x': expected a string, number or boolean"),
        ("  hp_y: [1, 2]\n", "'hyperparameters.hp_y': expected a string, number or boolean"),
        ("  hp_z: {a: 1}\n", "'hyperparameters.hp_z': expected a string, number or boolean"),
        ("  7: 1\n", f"line {MANY // 2 + 2}: the key '7' is not a string (int)"),
        ("  deep: " + "[" * 40 + "1" + "]" * 40 + "\n", "nested deeper than 32 levels"),
    ],
)
def test_a_bad_hyperparameter_among_many_is_named(tmp_path, bad_line, expected):
    path = write_job(tmp_path, many_hyperparameters(bad_line))
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path)}, path)
    assert expected in caught.value.reason


def aliased_list(items: int) -> str:
    """The root, two lists and the anchored list's items twice: 4 + 2 x items values once expanded."""
    return "x: &x [" + ", ".join(["1"] * items) + "]\ny: [*x]\n"


def test_the_value_bound_counts_scalars_walked_together(tmp_path):
    # The bound counts every value as construction would expand it, scalars counted a mapping or list at a time:
    # 100 000 values pass it (and fail later, on the unknown key), 100 002 do not.
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path)}, write_job(tmp_path, aliased_list(49_998)))
    assert "unknown key 'x'" in caught.value.reason
    with pytest.raises(ConfigError) as caught:
        spec.load({}, {"MA_HOME": str(tmp_path)}, write_job(tmp_path, aliased_list(49_999)))
    assert "expands to more than 100000 values" in caught.value.reason


# --------------------------------------------------------------------------- variables nothing reads


def test_every_variable_with_the_prefix_that_the_project_names_is_known():
    # The family: a name the runtime, its entrypoint shim or its test suite reads or sets must never be warned about
    # as unknown; a new one must be a setting or be listed in READ_ELSEWHERE.
    import re
    from pathlib import Path

    root = Path(spec.__file__).resolve().parents[2]
    sources = [*root.joinpath("ma_runtime").rglob("*.py"), root / "entrypoints" / "ma-runtime-entrypoint",
               root / "tests" / "suite_plugin.py"]
    named = {name for path in sources for name in re.findall(r"\bMA_RUNTIME_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())}
    environ = {name: "1" for name in named}
    assert spec.unknown_variables(environ) == []
    assert len(named) > 50  # the scan found the names (a wrong root would find none and pass)


def test_the_names_read_elsewhere_are_the_ones_their_readers_use():
    from ma_runtime import termination
    from ma_runtime.launch import torchrun_gate
    from ma_runtime.process import worker
    from ma_runtime.spec import jobfile, table
    from ma_runtime.supervise.stacks import registry

    readers = {jobfile.CONFIG_ENV, termination.PATH_ENV, worker.LINEAGE_ENV, registry.DIR_ENV, registry.SIGNAL_ENV,
               torchrun_gate.PREFIX_ENV}
    assert readers <= set(table.READ_ELSEWHERE)


def test_an_unknown_variable_names_the_closest_known_one_compared_without_the_prefix():
    found = spec.unknown_variables({"MA_RUNTIME_MAX_RESTART": "2", "MA_RUNTIME_HANG_DETECT_SECONDZ": "1",
                                           "MA_RUNTIME_QQQ": "1", "MA_RUN_METHOD": "x", "OTHER": "1"})
    assert [(w["variable"], w["hint"].split(" (")[0]) for w in found] == [
        ("MA_RUNTIME_HANG_DETECT_SECONDZ", "did you mean MA_RUNTIME_HANG_DETECT_SECONDS?"),
        ("MA_RUNTIME_MAX_RESTART", "did you mean MA_RUNTIME_MAX_RESTARTS?"),
        ("MA_RUNTIME_QQQ", "no setting reads it"),
    ]
