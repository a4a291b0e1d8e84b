"""`mmserve serve` as a real process: port 0, the logged address, a real request, a clean stop."""

import json
import os
import signal
import subprocess
import sys
import time

import openai

from tests.helpers import colour_question


def test_serve_process_on_port_zero():
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmserve.cli", "serve", "--port", "0", "--model", "demo"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = None
        deadline = time.monotonic() + 90
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "server exited before listening"
            event = json.loads(line)
            assert "actor" in event and "timestamp" in event
            if event["event"] == "http.listening":
                url = event["urls"][0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="demo", messages=colour_question("blue"), temperature=0)
        assert "blue" in r.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
