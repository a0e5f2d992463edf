"""pytest plugin: run a test suite (PEFT's own) with fastdora enabled process-wide.

    pytest -p fastdora_pytest_plugin ...    (this folder on PYTHONPATH)

Fails the session if fastdora's path never ran (so a broken hook cannot pass silently).
"""

import fastdora

_REPORT = fastdora.enable()


def _offline_english_quotes():
    """PEFT 0.18's test_initialization.py loads a hub dataset in a class body (at import). There is no network
    here: serve a small local stand-in for that one id so the module (and its DoRA tests) can be collected."""
    try:
        import datasets
    except ImportError:
        return
    real = datasets.load_dataset

    def load_dataset(path, *args, **kwargs):
        if path == "ybelkada/english_quotes_copy":
            quotes = [f"quote number {i}: the quick brown fox jumps over the lazy dog" for i in range(64)]
            ds = datasets.Dataset.from_dict({"quote": quotes, "author": ["anon"] * 64, "tags": [["x"]] * 64})
            return datasets.DatasetDict({"train": ds})
        return real(path, *args, **kwargs)

    datasets.load_dataset = load_dataset


_offline_english_quotes()


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
