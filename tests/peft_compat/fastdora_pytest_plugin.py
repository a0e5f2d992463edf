"""pytest plugin: run a test suite (PEFT's own) with fastdora enabled process-wide.

    pytest -p fastdora_pytest_plugin ...    (this folder on PYTHONPATH)

Fails the session if fastdora's path never ran (so a broken hook cannot pass silently).
"""

import fastdora

_REPORT = fastdora.enable()


def pytest_configure(config):
    config._fastdora_report = _REPORT


def pytest_report_header(config):
    return f"{_REPORT}"


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return  # xdist controller: the tests (and the check) run in the workers
    ran = {k: v for k, v in fastdora.active_path_counter.items() if k.endswith((":eager", ":triton"))}
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"fastdora paths run during the session: {dict(sorted(fastdora.active_path_counter.items()))}")
    if session.testscollected and not ran and exitstatus == 0:
        if tr is not None:
            tr.write_line("fastdora: ERROR - no fastdora forward ran during this session")
        session.exitstatus = 1
