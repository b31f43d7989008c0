"""Runs inside the sandbox, in front of the untrusted program. Never imported by the worker.

The sandbox starts ``python -I -S -c <_protocol.py + this file> MODE PROGRAM_FD REQUEST_FD REPLY_FD LIMITS``.
It reads the program from ``PROGRAM_FD``, sets resource limits that every process the program starts
inherits and cannot raise, then either

* ``script``: runs the program as ``__main__`` (stdin, stdout and stderr are pipes the parent holds);
* ``serve``: runs the program as the module ``solution``, then answers requests on the two
  descriptors: ``{"op": "names"}`` (the module's functions and plain-data constants) and
  ``{"op": "call", "name", "args", "kwargs"}``. Results go back as plain data (see ``_protocol``).

Nothing here decides a verdict: the program shares this process and could change any of it, so all
this side does is send values, which the trusted side compares with answers the program never sees.
"""

import builtins
import json
import os
import resource
import sys
import types

try:  # when linted or imported; inside the sandbox the protocol's source precedes this file
    from roll_rewards._protocol import Channel, ProtocolError, decode_value, encode_value
except ImportError:
    pass


def read_all(fd):
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def set_limits(limits):
    cpu = int(limits["cpu_seconds"])
    for name, value in (("RLIMIT_CPU", (cpu, cpu + 1)),
                        ("RLIMIT_AS", (limits["memory_mb"] << 20,) * 2),
                        ("RLIMIT_FSIZE", (int(limits["file_size_mb"] * (1 << 20)),) * 2),
                        ("RLIMIT_NPROC", (limits["max_processes"],) * 2),  # threads count too
                        ("RLIMIT_NOFILE", (limits["max_open_files"],) * 2),
                        ("RLIMIT_CORE", (0, 0))):
        resource.setrlimit(getattr(resource, name), value)


def describe(value):
    """How the trusted side sees a module attribute: a callable, a plain-data constant, or nothing."""
    if callable(value) and not isinstance(value, type(sys)):
        return "callable"
    try:
        return {"value": encode_value(value)}
    except ProtocolError:
        return None


def serve(namespace, channel):
    while True:
        try:
            request = channel.recv()
        except EOFError:
            return
        try:
            if request.get("op") == "names":
                names = {k: describe(v) for k, v in list(namespace.items()) if not k.startswith("__")}
                reply = {"names": {k: v for k, v in names.items() if v is not None}}
            else:
                function = namespace[request["name"]]
                args = decode_value(request.get("args", []))
                kwargs = decode_value(request.get("kwargs", {"$dict": []}))
                reply = {"value": encode_value(function(*args, **kwargs))}
        except BaseException as e:  # the program's exception (SystemExit included) is the call's result
            try:
                reply = {"error": type(e).__name__, "message": str(e)[:500]}
            except BaseException:
                reply = {"error": "Exception", "message": ""}
        channel.send(reply)


def main(argv):
    mode, program_fd, request_fd, reply_fd, limits = argv[1], int(argv[2]), int(argv[3]), int(argv[4]), argv[5]
    source = read_all(program_fd)
    set_limits(json.loads(limits))
    if mode == "script":
        sys.argv = ["main.py"]
        namespace = {"__name__": "__main__", "__file__": "main.py", "__builtins__": builtins}
        exec(compile(source, "main.py", "exec"), namespace)
        return
    module = types.ModuleType("solution")
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    sys.argv = ["solution.py"]
    exec(compile(source, "solution.py", "exec"), module.__dict__)
    serve(module.__dict__, Channel(request_fd, reply_fd))


main(sys.argv)
