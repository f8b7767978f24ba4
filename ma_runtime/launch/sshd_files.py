"""The files of this node's sshd: its private folder and the name ssh's words give it, the trust files, the
config files, and the keys ssh-keygen makes.

All live in one private folder of this node (0700), `folder(spec)`, under the runtime's state folder, named in
every config word as `named_folder(spec)` (a link in /tmp when its path is not plain: sshd.py says why). The
trust files are copies, each 0600, of `${MA_HOME}/.ssh` (`copy_trust`); `sshd_config` holds the runtime's lines
first, then the image's `${MA_HOME}/etc/ssh/sshd_config` with `{{MY_SSHD_PORT}}` replaced (`sshd_config_text`);
`ssh_config` is what mpirun's ssh reads (`ssh_config_text`). Every failure here is a ConfigError (78) naming
the path.
"""

import errno
import hashlib
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path
from typing import List, Optional, Sequence

from ma_runtime.errors import ConfigError, too_large_for_exec
from ma_runtime.process import children
from ma_runtime.util.files import NotAFile, read_regular, write_atomically

PLACEHOLDER = "{{MY_SSHD_PORT}}"
_FILE_LIMIT = 1 << 20  # a trust file or a config is a few KiB
_KEYGEN_SECONDS = 60.0
_PRIVATE_KEY_PREFIX = "id_"
AUTHORIZED = "authorized_keys"
# A path these characters make up reaches Open MPI's and OpenSSH's words as it is (module docstring); `=` is out
# too: old OpenSSH splits a config line at an `=` as at a space.
_PLAIN = re.compile(r"[A-Za-z0-9_./+,:@-]+\Z")
_LINKS = Path("/tmp")  # where the link to a folder whose path is not plain goes


def folder(spec) -> Path:
    """This node's private folder (its name says which node: the state folder may be shared)."""
    return spec.state_dir / f"mpi-{spec.task_name}-{spec.task_index}"


def named_folder(spec) -> Path:
    """The folder as ssh's and Open MPI's words name it: itself when its path is plain, else the link `start` makes
    to it in /tmp, named after the uid and the folder's path (the same folder gets the same link every run)."""
    real = folder(spec)
    if is_plain(str(real)):
        return real
    digest = hashlib.sha256(os.fsencode(str(real))).hexdigest()[:16]
    return _LINKS / f"ma-runtime-{os.geteuid()}-{digest}"


def is_plain(text: str) -> bool:
    return bool(_PLAIN.match(text))


def client_config(spec) -> Path:
    """What mpirun's ssh reads (`-F`), as plm_rsh_args names it."""
    return named_folder(spec) / "ssh_config"


def trust_folder(spec) -> Path:
    return spec.ma_home / ".ssh"


def private_folder(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # keys inside
    except OSError as exc:
        raise ConfigError(f"cannot make sshd's folder {path}: {exc.strerror or exc}",
                          hint="a multi-node mpirun job needs a writable MA_MOUNT_PATH (the runtime's state "
                               "folder is in it)") from None
    return path


def link(real: Path, named: Path) -> Path:
    """`named`, once it leads to `real`: the link made, or found made by this uid for this folder; ConfigError (78)
    when something else has the name or the link cannot be made. /tmp is sticky: a link we own stays ours."""
    if named == real:
        return named
    try:
        os.symlink(real, named)
        return named
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot link {named} to sshd's folder: {exc.strerror or exc}", hint=_LINK_HINT) from None
    try:
        found = os.lstat(named)
        ours = stat.S_ISLNK(found.st_mode) and found.st_uid == os.geteuid() and os.readlink(named) == str(real)
    except OSError:
        ours = False
    if not ours:
        raise ConfigError(f"{named} exists and is not this runtime's link to sshd's folder {str(real)!r}",
                          hint=f"remove {named}; " + _LINK_HINT)
    return named


# Why the link, and the way around it.
_LINK_HINT = ("the folder's path (under MA_MOUNT_PATH) has characters Open MPI and ssh cannot take in their options, "
              "so the runtime names it through a link in /tmp; /tmp must be writable, or give MA_MOUNT_PATH a path of "
              "letters, digits and _./+,:@- only")


def copy_trust(source: Path, target: Path, log) -> List[str]:
    """Every regular file of `source` (links followed: a Kubernetes secret volume holds links into `..data`),
    copied into `target`, recreated, each 0600. Returns their names."""
    shutil.rmtree(target, ignore_errors=True)
    try:
        target.mkdir(mode=0o700)
        names = sorted(os.listdir(source))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ConfigError(f"cannot read the trust files in {source}: {exc.strerror or exc}",
                          hint="the job's user must be able to read it") from None
    copied = []
    for name in names:
        if name.startswith("."):
            continue
        try:
            data = read_regular(source / name, _FILE_LIMIT)
            if data is not None:
                write_atomically(target / name, data, mode=0o600)
                copied.append(name)
        except NotAFile:
            continue  # a folder
        except OSError as exc:
            log.warning("trust file not copied", path=str(source / name), error=exc.strerror or str(exc))
    return copied


def private_keys(names: Sequence[str]) -> List[str]:
    return [name for name in names if name.startswith(_PRIVATE_KEY_PREFIX) and not name.endswith(".pub")]


def named_keys(names: Sequence[str], log) -> List[str]:
    """The trust files whose names ssh_config can hold as they are; the others are left out, with a warning."""
    for name in names:
        if not is_plain(name):
            log.warning("trust file not named in ssh_config: its name has characters ssh_config would take apart",
                        name=name, hint="rename it, e.g. id_rsa")
    return [name for name in names if is_plain(name)]


def keygen(path: Path, keygen: str, what: str, comment: Optional[str] = None) -> Path:
    """An ed25519 key pair at `path` (and `path`.pub), unless one is there: the host key, made once per pod."""
    if path.is_file():
        return path
    argv = [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(path), *(["-C", comment] if comment else [])]
    try:
        with children.owned(lambda: subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                     stderr=subprocess.STDOUT)) as proc:
            try:
                output, _ = proc.communicate(timeout=_KEYGEN_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
    except OSError as exc:  # it could not be started: one line, E2BIG with the sizes
        why = too_large_for_exec(argv, os.environ) if exc.errno == errno.E2BIG else exc.strerror or str(exc)
        raise ConfigError(f"cannot make {what} {path}: cannot run {keygen}: {why}",
                          hint="check that ssh-keygen works") from None
    if proc.returncode != 0 or not path.is_file():
        last = output.decode(errors="replace").strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
        raise ConfigError(f"cannot make {what} {path}: {last[0]}", hint="check that ssh-keygen works")
    return path


def sshd_config_text(spec, named: Path) -> str:
    """sshd's config; `named`: the folder as its words name it (plain)."""
    lines = [
        "# Written by ma-runtime for this node's sshd. sshd keeps the first value it reads for most keywords:",
        "# these lines come before the image's own config.",
        f"PidFile {named / 'sshd.pid'}",
        "UsePAM no",
        "StrictModes no",
        f"AuthorizedKeysFile {named / 'ssh' / 'authorized_keys'}",
        f"HostKey {named / 'ssh_host_ed25519_key'}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "ChallengeResponseAuthentication no",
        f"LogLevel {'INFO' if spec.log_level == 'debug' else 'FATAL'}",
    ]
    image = spec.ma_home / "etc" / "ssh" / "sshd_config"
    text = read_config(image)
    if text is not None:
        # The path stays out of the comment: a newline in it would make the rest a config line.
        lines += [f"# ${{MA_HOME}}/etc/ssh/sshd_config, its {PLACEHOLDER} replaced:",
                  text.replace(PLACEHOLDER, str(spec.sshd_port))]
    return "\n".join(lines) + "\n"


def ssh_config_text(trust: Path, names: Sequence[str]) -> str:
    """ssh's config; `trust`: the copied trust files' folder as its words name it (plain)."""
    lines = [
        "# Written by ma-runtime: what mpirun's ssh reads (-F). Each node's host key is made when it starts, so",
        "# none is known beforehand: the trust is in the job's keys.",
        "StrictHostKeyChecking no",
        "UserKnownHostsFile /dev/null",
        "BatchMode yes",
        "LogLevel ERROR",
        "ConnectTimeout 30",
        *(f"IdentityFile {trust / name}" for name in private_keys(names)),
    ]
    if "config" in names:
        lines += [f"# {trust / 'config'}:", (trust / "config").read_text(errors="replace")]
    return "\n".join(lines) + "\n"


def read_config(path: Path) -> Optional[str]:
    try:
        data = read_regular(path, _FILE_LIMIT)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}",
                          hint="it must be a readable file of sshd's configuration") from None
    return None if data is None else data.decode("utf-8", "replace")


def write_private(path: Path, text: str) -> None:
    try:
        write_atomically(path, text, mode=0o600)
    except OSError as exc:
        raise ConfigError(f"cannot write {path}: {exc.strerror or exc}",
                          hint="a multi-node mpirun job needs a writable MA_MOUNT_PATH") from None


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
