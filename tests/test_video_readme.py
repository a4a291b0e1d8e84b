"""The README's video example over HTTP: the trained `demo-qwen` names the colour of the shape in
a clip the project's renderer draws and PyAV encodes, and says whether it moves (the embedded
example runs with the README's other embedded examples, tests/test_readme.py)."""

from __future__ import annotations

import re

import pytest

from tests.helpers import ServerThread
from tests.test_readme import README, _expected, _run_against

BLOCK = re.compile(r"<!-- tests/test_video_readme.py runs this block against a demo server -->\n```python\n(.*?)^```",
                   re.M | re.S)


@pytest.fixture(scope="module")
def qwen_server(three_model_config):
    """A server with the demo models `demo-qwen` among them (the default config's)."""
    with ServerThread(three_model_config) as server:
        yield server


def test_readme_video_example_answers_over_http(qwen_server):
    (code,) = BLOCK.findall(README.read_text())
    assert "video_url" in code and "http://127.0.0.1:8000" in code
    out = _run_against(qwen_server, code, {})
    assert _expected(code) == ["blue", "yes"] and out.split() == ["blue", "yes"], out
