"""An endpoint that never answers (issue 30, item 2): a wrong port or host is found within a few attempts, not
waited out for the retry budget; the final sync does not try it again; retries are logged once, then counted; a
run without credentials says so in one line. An endpoint that answered before and then fails (an outage in the
middle of a job) still gets the whole MA_RUNTIME_STORAGE_RETRY_SECONDS.

Real endpoints throughout: a port where nothing listens (refused), a real HTTP server stopped in the middle (the
outage), and moto for the answers.
"""

import http.server
import json
import threading

import pytest

from ma_runtime import spec as job_spec
from ma_runtime.storage import reach
from ma_runtime.storage import url as storage_url
from ma_runtime.storage.base import EndpointDead, NotFound, TransientError
from ma_runtime.storage.stores import open_store
from ma_runtime.storage.transfer import Calls, TransferOptions
from tests.conftest import log_dir, run_ma
from tests.recording import Log
from tests.storage_env import refusing_endpoint

OUTPUT_JOB = {"outputs": [{"name": "train_url", "url": "obs://bucket/x/", "mode": "env"}]}
WRITE_AND_FINISH = 'echo hi > "$train_url/a.txt"; echo done'
# A bound far above what the rule allows (5 attempts: about 5 s) and far below the 120 s budget: a guard against a
# hang, not the measure (the measure is the count of attempts in the error).
GUARD_SECONDS = 90
# What a clear error must not be followed by (issue 30): the uploader's crash, a deadline blamed, an unknown file.
MISLEADING = ("upload process failed", "final sync incomplete", "(unknown", "upload process exited")


@pytest.fixture(autouse=True)
def _fresh_run():
    reach.forget()  # the unit tests below share this process's record
    yield
    reach.forget()


def job(tmp_path, document) -> str:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(document))
    return str(path)


def refused_env(job_env, **more):
    job_env.update(MA_S3_ENDPOINT=refusing_endpoint(), OBS_ACCESS_KEY_ID="ak", OBS_SECRET_ACCESS_KEY="sk-secret-value")
    job_env.update({name: str(value) for name, value in more.items()})
    return job_env


def lines(result, event):
    return [line for line in result.stderr.splitlines() if f'msg="{event}' in line]


def termination(env):
    return json.loads((log_dir(env) / "modelarts-job-local-worker-0-termination.json").read_text())


def test_a_refused_endpoint_at_stage_in_fails_after_a_few_attempts_with_one_retry_line(tmp_path, job_env):
    env = refused_env(job_env)  # the default budget: MA_RUNTIME_STORAGE_RETRY_SECONDS=120
    document = {"outputs": [{**OUTPUT_JOB["outputs"][0], "predownload": True}]}

    result = run_ma(["--config", job(tmp_path, document), "sh", "-c", WRITE_AND_FINISH], env, timeout=GUARD_SECONDS)

    assert result.returncode == 80 and "Traceback" not in result.stderr
    (error,) = lines(result, "error,exiting")
    assert "(failed 5 times in" in error and "never answered in this run" in error
    assert "check the endpoint" in error and env["MA_S3_ENDPOINT"] in error
    assert len(lines(result, "storage request failed, retrying")) == 1  # once, not once per attempt
    assert not lines(result, "storage requests still failing")
    assert not any(text in result.stderr for text in MISLEADING)
    assert len(lines(result, "final sync skipped")) == 1  # the channel's endpoint is dead: not tried again
    assert "sk-secret-value" not in result.stderr


def test_first_contact_attempts_is_the_setting(tmp_path, job_env):
    env = refused_env(job_env, MA_RUNTIME_STORAGE_FIRST_CONTACT_ATTEMPTS=2)
    document = {"outputs": [{**OUTPUT_JOB["outputs"][0], "predownload": True}]}

    result = run_ma(["--config", job(tmp_path, document), "true"], env, timeout=GUARD_SECONDS)

    (error,) = lines(result, "error,exiting")
    assert result.returncode == 80 and "(failed 2 times in" in error


def test_a_command_that_succeeds_against_a_refused_endpoint_exits_80_naming_the_endpoint(tmp_path, job_env):
    env = refused_env(job_env)

    result = run_ma(["--config", job(tmp_path, OUTPUT_JOB), "sh", "-c", WRITE_AND_FINISH], env, timeout=GUARD_SECONDS)

    assert result.returncode == 80 and "done" in result.stdout and "Traceback" not in result.stderr
    (error,) = lines(result, "error,exiting")
    assert "never answered in this run" in error and env["MA_S3_ENDPOINT"] in error
    assert "MA_RUNTIME_FINAL_SYNC_SECONDS" not in error  # not the deadline's fault
    assert len(lines(result, "storage request failed, retrying")) <= 1
    assert not any(text in result.stderr for text in MISLEADING[:1] + MISLEADING[2:])
    message = termination(env)
    assert message["exit_code"] == 80 and "never answered" in message["reason"]


def test_no_credentials_is_one_line_before_the_command_and_nothing_after(tmp_path, job_env):
    job_env["MA_S3_ENDPOINT"] = refusing_endpoint()

    result = run_ma(["--config", job(tmp_path, OUTPUT_JOB), "sh", "-c", WRITE_AND_FINISH], job_env, timeout=60)

    assert result.returncode == 80 and "done" not in result.stdout and "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if "level=warning" in line or "level=error" in line]
    assert len(warnings) == 1 and "no OBS credentials" in warnings[0] and "train_url" in warnings[0], warnings
    assert not any(text in result.stderr for text in MISLEADING + ("not synced",))
    message = termination(job_env)
    assert message["exit_code"] == 80 and message["stage"] == "stage-in"


# ------------------------------------------------------------------ the rule itself, against real endpoints


class Answering(http.server.BaseHTTPRequestHandler):
    """An endpoint that answers every request 404 (an answer: the endpoint is there)."""

    def _no(self):
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = _no

    def log_message(self, *args):
        pass


def store_at(endpoint, tmp_path):
    env = {"MA_S3_ENDPOINT": endpoint, "OBS_ACCESS_KEY_ID": "ak", "OBS_SECRET_ACCESS_KEY": "sk",
           "MA_HOME": str(tmp_path / "home")}
    return open_store(storage_url.parse("obs://b/"), job_spec.load({}, env), env)


def test_an_endpoint_that_answered_then_refuses_keeps_the_whole_retry_budget(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    store = store_at(f"http://127.0.0.1:{server.server_address[1]}", tmp_path)
    with pytest.raises(NotFound):
        store.head("b", "k")  # it answered
    server.shutdown()
    server.server_close()  # the outage: every connection refused from now on
    log = Log()
    calls = Calls(TransferOptions(retry_seconds=2.0, first_contact_attempts=1), log)

    with pytest.raises(TransientError, match=r"failed \d+ times in") as failure:
        calls(store.head, "b", "k")

    assert not isinstance(failure.value, EndpointDead)
    attempts = int(str(failure.value).split("failed ")[1].split(" times")[0])
    assert attempts > 1  # retried through the budget, not stopped at the first-contact attempts
    assert [event for _, event, _ in log.records].count("storage request failed, retrying") == 1


def test_an_endpoint_that_never_answered_is_found_dead_then_tried_once_per_request(tmp_path):
    endpoint = refusing_endpoint()
    store = store_at(endpoint, tmp_path)
    log = Log()
    calls = Calls(TransferOptions(retry_seconds=60.0, first_contact_attempts=3), log)

    with pytest.raises(EndpointDead, match=r"failed 3 times in .*never answered") as failure:
        calls(store.head, "b", "k")
    assert endpoint in failure.value.hint and reach.dead_cause(endpoint)

    log.records.clear()
    with pytest.raises(EndpointDead, match="found dead earlier"):
        calls(store.head, "b", "other")  # one attempt, no retry line
    assert not log.records


def test_retries_log_once_then_a_count_and_the_success_says_how_many(tmp_path):
    log = Log()
    calls = Calls(TransferOptions(retry_seconds=30.0), log)
    calls._wait = lambda state: 0.0
    failures = iter(range(6))

    def flaky():
        if next(failures, None) is not None:
            raise TransientError("HTTP 503")
        return "ok"

    assert calls(flaky) == "ok"

    events = [(level, event) for level, event, _ in log.records]
    assert events == [("warning", "storage request failed, retrying"),
                      ("info", "storage request succeeded after retrying")]
    assert log.records[-1][2]["failures"] == 6 and log.records[-1][2]["attempts"] == 7
