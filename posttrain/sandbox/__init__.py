"""Layer 0: the sandbox: where text and code a model wrote run (docs/safety.md). Plain Python, no torch:
it is imported inside the sandbox too.

    launch.py   which isolation (`decide`), and starting a program in it (`spawn`)
    run.py      a program run to its end: bounded output, time and memory (the python tool)
    procs.py    process trees and groups from /proc (memory in all, killing all of it)
    seccomp.py  the syscall filter, and the prctl flags a sandboxed process sets
    cgroup.py   a memory (and process-count) cgroup per sandbox, where the machine allows one
"""
