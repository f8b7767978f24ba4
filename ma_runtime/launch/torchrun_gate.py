"""The gate of a torchrun job restarted in place (docs/torchrun-in-place.md): one file, standard library only, run
by its path, in two roles.

torchrun's agent lives for the whole run (launch/torchrun.py starts it as the job's service, with a restart
budget of its own that never runs out) and restarts its ranks itself; each rank it starts is this file's *shim*,
which waits at the gate until the runtime's attempt lets it go. One attempt's worker is this file's *gate*. So the
runtime still decides every attempt (its policy, the device wait, the barrier of the nodes) while torchrun's
restart costs what torchrun's own does: no new agent, no torch import.

The shim (`python -u torchrun_gate.py shim`), as torchrun starts it, the leader of the rank's process group:
- binds the datagram socket `<prefix>-rank-<LOCAL_RANK>` (Linux's abstract namespace: no file, gone with the
  process; `<prefix>` from MA_RUNTIME_TORCHRUN_GATE) and waits for `go`: a JSON object with the attempt's
  number, its program (`--python SCRIPT ARGS`: on the shim's interpreter, unbuffered, as torchrun runs a script;
  `--program PROG ARGS`: as given, torchrun's --no-python) and what the attempt's environment sets and unsets
  against the agent's (MA_PROC_START_CNT with it);
- runs the program as its child, in its group (torchrun's signals to the group reach it as they reach a rank it
  started itself), its standard output and error the gate's own (passed with `go`, SCM_RIGHTS): the ranks' lines
  reach the runtime through the attempt's worker, as a torchrun restarted whole gives them, so the attempt's tail,
  its termination message and the guard's pipes are the same; tells the gate it started and, when it ends, how
  (`exit`), and exits as its child did.

The gate (`torchrun_gate.py gate --agent FILE --nproc N --kill-after SECONDS [--store-port PORT] -- PROGRAM`), one
attempt's worker:
- reads the agent's pid and socket prefix from FILE (written when the service starts), lets every local rank go
  with the program, its own stdout and stderr, and its environment's difference to the agent's (torchrun's
  per-rank variables left as torchrun set them, but for --store-port on several nodes: MASTER_PORT=PORT and
  TORCHELASTIC_USE_AGENT_STORE=False, a store of the attempt's own for its ranks, see _ranks_store);
- collects the exits. The first non-zero one is the attempt's: once every rank is gone (torchrun stops the
  others and restarts the group, whose new shims wait at the gate) it prints torchrun's summary for it (`Root
  Cause (first observed failure):`, the rank and its exit code: launch/torchrun.root_cause reads it) and exits
  with that rank's status. Every rank's 0 is the attempt's 0 once the agent has ended too (its group done, it
  exits by itself: not stopped by the run's end halfway), bounded by --kill-after;
- stopped (SIGTERM or SIGINT: a stop, a hang, another node's failure), signals each rank's group as torchrun
  would, and SIGKILLs them after --kill-after seconds (within the runtime's grace: the ranks are in the
  service's tree, which the attempt's own kill does not reach); SIGHUP, SIGUSR1 and SIGUSR2 are passed on;
- exits 1, saying so, when the agent is gone: there is nothing to restart in place any more.
"""

import array
import json
import os
import signal
import socket
import sys
import time

PREFIX_ENV = "MA_RUNTIME_TORCHRUN_GATE"
# What torchrun's agent sets in each rank's environment (torch/distributed/elastic/agent/server/
# local_elastic_agent.py `_start_workers`): the attempt's environment never replaces them.
TORCHRUN_NAMES = frozenset({
    "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS", PREFIX_ENV})
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)
POLL_SECONDS = 0.25  # how often the gate looks at the agent and its deadline while it waits
SEND_EVERY = 0.005  # how often the gate tries a rank socket that is not bound yet (the rank is starting)
PARENT_CHECK_SECONDS = 1.0  # how often a waiting shim looks whether its agent is still there
# A unix datagram carries at most the socket's send buffer (net.core.wmem_max, 208 KiB by default).
SEND_BUFFER = 4 * 1024 * 1024
PASSED_ON = (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
OUTPUTS = array.array("i", (1, 2))  # the gate's stdout and stderr: each rank's
STOPPING = (signal.SIGTERM, signal.SIGINT)


def _address(prefix, name):
    return "\0" + prefix + "-" + name


def _status(code):
    """A waitpid status as Popen's returncode: the exit code, or -N for death by signal N."""
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _exit_as(returncode):
    """Ends this process as `returncode` says: by the same signal, or with the same code."""
    sys.stdout.flush()
    sys.stderr.flush()
    if returncode < 0:
        signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
        time.sleep(1)  # the signal is pending: it ends the process
        returncode = 128 - returncode
    os._exit(returncode)


# --------------------------------------------------------------------------- the shim (each rank)


def shim(_argv):
    prefix, local_rank = os.environ[PREFIX_ENV], os.environ.get("LOCAL_RANK", "0")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    _bind(sock, _address(prefix, "rank-" + local_rank))
    message, descriptors = _wait_for_go(sock)
    outputs = _descriptors(descriptors)
    go = json.loads(message.decode())
    sock.close()  # the next generation's shim of this rank binds the name
    program = _program(go["program"])
    env = dict(os.environ)
    env.update(go["set"])
    for name in go["unset"]:
        env.pop(name, None)
    env.pop(PREFIX_ENV, None)
    child = os.fork()
    if child == 0:
        for target, given in zip((1, 2), outputs):
            os.dup2(given, target)
        try:
            os.execvpe(program[0], program, env)
        except OSError as exc:
            sys.stderr.write(f"torchrun's rank {os.environ.get('RANK')}: cannot run {program[0]}: {exc}\n")
            os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    for given in outputs:
        os.close(given)
    # The signals torchrun sends reach the child through the group: the shim waits for it and says how it ended.
    for signum in (*STOPPING, *PASSED_ON, signal.SIGQUIT):
        signal.signal(signum, lambda *_: None)
    report = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    gate = _address(prefix, "gate")
    _tell(report, gate, {"started": go["attempt"], "local_rank": local_rank, "rank": os.environ.get("RANK"),
                         "pid": os.getpid()})
    while True:
        try:
            _, code = os.waitpid(child, 0)
            break
        except InterruptedError:
            continue
    returncode = _status(code)
    _tell(report, gate, {"exit": go["attempt"], "local_rank": local_rank, "returncode": returncode})
    _exit_as(returncode)


def _wait_for_go(sock):
    """The gate's `go` (the message and its descriptors). A shim whose agent is gone (its parent changed: killed,
    not stopped, so it could not end its ranks) exits instead: no gate will ever come for it."""
    agent = os.getppid()
    sock.settimeout(PARENT_CHECK_SECONDS)
    while True:
        try:
            message, descriptors, _, _ = sock.recvmsg(SEND_BUFFER, socket.CMSG_SPACE(2 * OUTPUTS.itemsize))
            return message, descriptors
        except socket.timeout:
            if os.getppid() != agent:
                sys.stderr.write(f"torchrun's rank {os.environ.get('RANK')}: its agent (pid {agent}) is gone\n")
                os._exit(1)


def _descriptors(ancillary):
    """The gate's stdout and stderr, as SCM_RIGHTS brought them."""
    found = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            found.frombytes(data[:len(data) - len(data) % found.itemsize])
    return list(found)


def _program(argv):
    """`--python SCRIPT ARGS`: the script on this interpreter, unbuffered, as torchrun runs it; `--program PROG
    ARGS` as given (torchrun's --no-python)."""
    kind, rest = argv[0], list(argv[1:])
    return [sys.executable, "-u", *rest] if kind == "--python" else rest


def _bind(sock, address, seconds=30.0):
    """The name is free once the last holder got its go or ended; a holder still closing is waited for."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            sock.bind(address)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _tell(sock, address, message):
    """To the gate, if it still listens: a gate that is gone (stopped, killed) learns nothing more."""
    try:
        sock.sendto(json.dumps(message).encode(), address)
    except OSError:
        pass


# --------------------------------------------------------------------------- the gate (each attempt)


class _Gate:
    def __init__(self, agent, prefix, nproc, kill_after, program, store_port=None):
        self.agent, self.prefix, self.nproc, self.kill_after = agent, prefix, nproc, kill_after
        self.program = program
        self.store = _ranks_store(store_port)
        self.attempt = int(os.environ.get("MA_PROC_START_CNT", "0"))
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
        self.let_go = set()  # local ranks sent their go
        self.ranks = {}  # local rank -> {"pid": the shim's pid (its group), "rank": the global rank}
        self.exits = {}  # local rank -> returncode
        self.first_failure = None  # local rank
        self.stop_signal = None
        self.kill_at = None

    def run(self):
        _bind(self.sock, _address(self.prefix, "gate"))
        for signum in STOPPING:
            signal.signal(signum, self._on_stop)
        for signum in PASSED_ON:
            signal.signal(signum, self._pass_on)
        self._check()  # an agent already gone has no environment to compare with
        go = self._go()
        waiting = set(range(self.nproc))
        while waiting or self.let_go - set(self.exits):
            if self.stop_signal is not None:
                waiting.clear()  # a rank not let go yet waits for the next attempt's gate
            waiting = self._let_go(waiting, go)
            self._receive()
            self._check()
        return self._end()

    def _go(self):
        """What each rank's environment sets and unsets against the agent's: the attempt's own variables."""
        agent_env = _environ_of(self.agent)
        mine = {name: value for name, value in os.environ.items() if not _torchrun_name(name)}
        changed = {name: value for name, value in mine.items() if agent_env.get(name) != value}
        gone = [name for name in agent_env if name not in mine and not _torchrun_name(name)]
        changed.update(self.store)
        return json.dumps({"attempt": self.attempt, "program": self.program, "set": changed,
                           "unset": gone}).encode()

    def _let_go(self, waiting, go):
        for local_rank in sorted(waiting):
            try:
                self.sock.sendmsg([go], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, OUTPUTS.tobytes())], 0,
                                  _address(self.prefix, f"rank-{local_rank}"))
                waiting = waiting - {local_rank}
                self.let_go.add(local_rank)
            except (ConnectionRefusedError, FileNotFoundError):
                pass  # torchrun has not started this rank yet (it is stopping the last group, or rendezvousing)
        return waiting

    def _receive(self, timeout=None):
        starting = len(self.ranks) < self.nproc and self.stop_signal is None
        self.sock.settimeout(timeout if timeout is not None else SEND_EVERY if starting else POLL_SECONDS)
        try:
            message = json.loads(self.sock.recv(65536).decode())
        except (OSError, ValueError):  # nothing within the timeout (socket.timeout, BlockingIOError)
            return
        local_rank = int(message["local_rank"])
        if message.get("started") == self.attempt:
            self.ranks[local_rank] = {"pid": int(message["pid"]), "rank": message.get("rank")}
            if self.stop_signal is not None:
                _signal_group(self.ranks[local_rank]["pid"], self.stop_signal)
        elif message.get("exit") == self.attempt:
            self._ended(local_rank, int(message["returncode"]))

    def _ended(self, local_rank, returncode):
        if local_rank in self.exits:
            return
        self.exits[local_rank] = returncode
        if returncode != 0 and self.first_failure is None and self.stop_signal is None:
            self.first_failure = local_rank

    def _check(self):
        """A shim gone without a word (torchrun's SIGKILL reaches its whole group) ended as SIGKILL says; the agent
        gone: its ranks are orphans of no attempt; the deadline of a stop: SIGKILL."""
        for local_rank, started in list(self.ranks.items()):
            if local_rank not in self.exits and not _alive(started["pid"]):
                self._receive(0.0)  # its last word may be queued still
                self._ended(local_rank, -signal.SIGKILL)
        if not _alive(self.agent):
            sys.stderr.write(f"torchrun's agent (pid {self.agent}) is gone: the job cannot be restarted in place; "
                             "its last lines are above\n")
            self._signal_ranks(signal.SIGKILL)
            _exit_as(1)
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            self._signal_ranks(signal.SIGKILL)
            self.kill_at = None

    def _on_stop(self, signum, _frame):
        if self.stop_signal is None:
            self.stop_signal = signum
            self.kill_at = time.monotonic() + self.kill_after
            self._signal_ranks(signum)

    def _pass_on(self, signum, _frame):
        self._signal_ranks(signum)

    def _signal_ranks(self, signum):
        for local_rank, started in list(self.ranks.items()):
            if local_rank not in self.exits:
                _signal_group(started["pid"], signum)

    def _end(self):
        if self.first_failure is not None:
            started = self.ranks[self.first_failure]
            returncode = self.exits[self.first_failure]
            # torchrun's own summary, as launch/torchrun.root_cause reads it, and ending as it does: the attempt's
            # last line is the same whichever pid failed (the same-failure limit compares it).
            sys.stderr.write(f"Root Cause (first observed failure):\n[0]:\n  rank      : {started['rank']} "
                             f"(local_rank: {self.first_failure})\n"
                             f"  exitcode  : {returncode} (pid: {started['pid']})\n{'=' * 60}\n")
            _exit_as(returncode)
        if self.stop_signal is not None:
            _exit_as(128 + self.stop_signal)
        code = next((code for code in self.exits.values() if code != 0), 0)
        if code == 0:
            self._agent_done()
        _exit_as(code)

    def _agent_done(self):
        """Every rank exited 0: the agent finds its group done at its next look and exits by itself (after its exit
        barrier, on several nodes); bounded, so that the run's end does not stop it in the middle of that."""
        deadline = time.monotonic() + self.kill_after
        while _alive(self.agent) and time.monotonic() < deadline:
            time.sleep(0.02)


def _ranks_store(port):
    """What replaces torchrun's store variables on several nodes: torch's static rendezvous keeps one TCPStore, the
    agents', for the whole run, and by default its ranks use it too (TORCHELASTIC_USE_AGENT_STORE=True, no prefix
    per restart: torch/distributed/rendezvous.py `_create_c10d_store`), so a restart's ranks would read the
    addresses the last attempt's left there. With these, global rank 0 hosts a new store for its attempt's ranks on
    MASTER_ADDR:port, as torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE gives on one node."""
    if port is None:
        return {}
    return {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _torchrun_name(name):
    return name in TORCHRUN_NAMES or name.startswith(TORCHRUN_PREFIXES)


def _environ_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            entries = handle.read().split(b"\0")
    except OSError:  # it ended since the last look: the next look says so
        return {}
    pairs = (entry.decode(errors="surrogateescape").partition("=") for entry in entries if b"=" in entry)
    return {name: value for name, _, value in pairs}


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] != b"Z"


def _signal_group(pid, signum):
    try:
        os.killpg(pid, signum)
    except OSError:
        pass  # it ended meanwhile


def gate(argv):
    options, program = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    value = dict(zip(options[::2], options[1::2]))
    with open(value["--agent"]) as handle:
        agent = json.load(handle)
    store_port = int(value["--store-port"]) if "--store-port" in value else None
    return _Gate(int(agent["pid"]), agent["prefix"], int(value["--nproc"]), float(value["--kill-after"]),
                 program, store_port).run()


if __name__ == "__main__":
    role, arguments = sys.argv[1], sys.argv[2:]
    sys.exit(shim(arguments) if role == "shim" else gate(arguments))
