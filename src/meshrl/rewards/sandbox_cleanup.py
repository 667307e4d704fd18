"""Removing what a sandbox run leaves in the temporary directory, without ever following a link.

The working directory is written by untrusted code, and the temporary directory by anyone: a program can leave
``a/link -> /some/dir`` and ``chmod 000 a``, and any local user can plant ``meshrl-sandbox-<dead pid>-x ->
/some/tree``. A clean-up that made unreadable parts readable through a path (``os.walk`` then ``os.chmod``)
changed the mode of whatever such a link named. Here every step works on file descriptors opened with
``O_NOFOLLOW`` relative to their parent, a mode is changed only through the descriptor of the directory itself
(``/proc/self/fd``), and a top-level entry is removed only if it is a real directory owned by the caller.

No meshrl imports: tests load this file on its own under another interpreter and user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat

log = logging.getLogger(__name__)

OWNED_PREFIX = "meshrl-sandbox-"  # + the creating process's pid + "-": who must clean it up
_OWNED = re.compile(rf"^{OWNED_PREFIX}(\d+)-")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def orphans(base: str) -> list[str]:
    """Entries in ``base`` named by :data:`OWNED_PREFIX` whose creating process is gone (links included:
    :func:`remove_owned_dir` refuses them)."""
    try:
        names = os.listdir(base)
    except OSError:
        return []
    found = []
    for name in names:
        m = _OWNED.match(name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            found.append(os.path.join(base, name))
    return found


def remove_owned_dir(path: str) -> bool:
    """Remove ``path`` and everything in it if it is a real directory (not a link) owned by this process's
    user; never follows a link below it either. ``False`` (and nothing touched) otherwise."""
    parent, name = os.path.split(os.path.abspath(path))
    try:
        parent_fd = os.open(parent, _DIR_FLAGS & ~os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            log.warning("sandbox clean-up: %s is not a directory of this user; left alone", path)
            return False
        _remove_entry(parent_fd, name, depth=0)
        return True
    except OSError:
        return False
    finally:
        os.close(parent_fd)


def _open_dir(parent_fd: int, name: str) -> int | None:
    """A descriptor of the real directory ``name`` in ``parent_fd``, made readable by its owner if the program
    took the permissions away (through the descriptor: the path could be swapped for a link meanwhile)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        pass
    try:
        path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
    except OSError:
        return None
    try:
        os.chmod(f"/proc/self/fd/{path_fd}", 0o700)  # the inode path_fd holds, never a link's target
        return os.open(".", _DIR_FLAGS, dir_fd=path_fd)
    except OSError:
        return None
    finally:
        os.close(path_fd)


def _remove_entry(parent_fd: int, name: str, depth: int) -> None:
    """Remove ``name`` in ``parent_fd``: a link or file is unlinked, a directory emptied first."""
    with contextlib.suppress(FileNotFoundError):
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent_fd)
            return
        if depth < 400:  # deeper trees stay (rmdir below fails); recursion would run out first
            fd = _open_dir(parent_fd, name)
            if fd is not None:
                try:
                    for entry in os.listdir(fd):
                        with contextlib.suppress(OSError):
                            _remove_entry(fd, entry, depth + 1)
                finally:
                    os.close(fd)
        os.rmdir(name, dir_fd=parent_fd)
