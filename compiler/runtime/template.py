"""Chat templates, rendered as the untrusted programs they are: Jinja's sandbox, bounded.

    template text ─► fork ─► child: address space + 256 MiB, CPU 10 s (then the kernel ends it),
                              jinja2 ImmutableSandboxedEnvironment, each conversation rendered
                              piece by piece and stopped past MAX_RENDERED characters
                  ◄─ pipe ─ the rendered texts (JSON), or the failure as one line
    parent: waits at most TIMEOUT s of wall time, then kills the child

The sandbox refuses Python internals (`__class__`, `mro`, ...); the child's limits bound what
the sandbox cannot see (a string doubled 40 times, a loop of loops). A syntax error, a
`raise_exception` call, an undefined name, a sandbox refusal or a bound exceeded are all an
InputError naming the template (exit 2). Variables: `messages`, `add_generation_prompt`, the
tokenizer's special tokens, `raise_exception`, `strftime_now` (SOURCE_DATE_EPOCH when set:
same input, same bytes), Jinja's `loopcontrols`; `tojson` without HTML escaping.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import time

from mtkc.errors import InputError

MAX_RENDERED = 4 << 20  # characters per rendered conversation
MAX_MEMORY = 256 << 20  # bytes of address space the child may add
CPU_SECONDS = 10
TIMEOUT = 15.0  # wall seconds


def render(template: str, where: str, conversations: list[list[dict]], variables: dict[str, str]) -> list[str]:
    """Each conversation rendered with `add_generation_prompt=True`; InputError naming `where` on any failure."""
    try:
        import jinja2.sandbox  # noqa: F401  (imported before the fork: the child only renders)
    except ImportError:
        raise InputError("--chat-template needs the `jinja2` package (pip install jinja2)") from None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: render, report, exit without running the parent's cleanup
        os.close(read)
        try:
            _limit()
            reply = {"texts": [_render_one(template, messages, variables) for messages in conversations]}
        except BaseException as exc:  # anything the template makes Python raise, reported as one line
            reply = {"error": _describe(exc)}
        try:
            with os.fdopen(write, "w", encoding="utf-8", errors="surrogatepass") as f:
                json.dump(reply, f)
        finally:
            os._exit(0)
    os.close(write)
    try:
        data, status = _collect(read, pid, len(conversations))
    finally:
        os.close(read)
    if data is None:
        raise InputError(f"{where}: the chat template ran past {TIMEOUT:g} s; nothing was rendered")
    if not os.WIFEXITED(status) or not data:
        raise InputError(f"{where}: the chat template exceeded the renderer's bounds ({CPU_SECONDS} s of CPU, "
                         f"{MAX_MEMORY >> 20} MiB of memory)")
    reply = json.loads(data.decode("utf-8", errors="surrogatepass"))
    if "error" in reply:
        raise InputError(f"{where}: the chat template fails: {reply['error']}")
    return reply["texts"]


def _collect(fd: int, pid: int, count: int) -> tuple[bytes | None, int]:
    """The child's reply (None on timeout) and its wait status; the child is always reaped."""
    chunks, size, limit = [], 0, count * (MAX_RENDERED * 6 + 64) + 4096  # JSON-escaped worst case
    deadline = time.monotonic() + TIMEOUT
    running = True
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None, 0
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # EOF: the child has replied and is exiting
                running = False
                return b"".join(chunks), os.waitpid(pid, 0)[1]
            size += len(chunk)
            if size > limit:
                return b"", 0
            chunks.append(chunk)
    finally:
        if running:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS + 1))
    try:
        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (used + MAX_MEMORY, used + MAX_MEMORY))
    except (OSError, ValueError):  # no /proc (not Linux): the CPU and wall bounds still hold
        pass


def _render_one(template: str, messages: list[dict], variables: dict[str, str]) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    compiled = env.from_string(template)
    pieces, size = [], 0
    for piece in compiled.generate(**variables, messages=messages, add_generation_prompt=True):
        size += len(piece)
        if size > MAX_RENDERED:
            raise _TooLong()
        pieces.append(piece)
    return "".join(pieces)


class _TooLong(Exception):
    def __str__(self) -> str:
        return f"it renders more than {MAX_RENDERED >> 20} Mi characters"


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return time.strftime(str(fmt), time.gmtime(int(epoch)) if epoch and epoch.isdigit() else time.localtime())


def _describe(exc: BaseException) -> str:
    from jinja2.exceptions import SecurityError, TemplateSyntaxError

    if isinstance(exc, TemplateSyntaxError):
        return f"syntax error at line {exc.lineno}: {exc.message}"
    if isinstance(exc, SecurityError):
        return f"the sandbox refused it ({str(exc)[:200]})"
    if isinstance(exc, MemoryError):
        return f"it needs more than {MAX_MEMORY >> 20} MiB"
    if isinstance(exc, RecursionError):
        return "it recurses too deeply"
    if isinstance(exc, _TooLong):
        return str(exc)
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
