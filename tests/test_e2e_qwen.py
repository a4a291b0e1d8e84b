"""The trained Qwen2-VL demo over HTTP, with the `openai` client on a real socket: images of
different sizes and aspect ratios (a different token count each) answered right, two images of
different sizes in one message, a later turn that hits the prefix cache, and the same image sent
to a LLaVA and to the Qwen2-VL model never sharing an encoder output."""

import openai
import pytest
import structlog

from mmserve.models.demo import Q_BACKGROUND, Q_COLOR, Q_FIRST, Q_SECOND, Q_SHAPE, render_image
from tests.helpers import ServerThread, image_part


@pytest.fixture(scope="module")
def client(three_model_config):
    with ServerThread(three_model_config) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def user(images, question: str) -> dict:
    return {"role": "user", "content": [image_part(img) for img in images] + [{"type": "text", "text": question}]}


def answer(client, messages, model: str = "demo-qwen"):
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=4)
    return r.choices[0].message.content.strip(), r.usage


@pytest.mark.parametrize("size", [(32, 32), (128, 40), (48, 112), (96, 96), (80, 64)])
def test_images_of_any_size_are_answered(client, size):
    img = render_image("purple", "triangle", background="white", seed=71, size=size)
    got = [answer(client, [user([img], q)])[0] for q in (Q_COLOR, Q_BACKGROUND)]
    assert got == ["purple", "white"]


def test_two_images_of_different_sizes_and_a_later_turn(client):
    first = render_image("red", "circle", background="black", seed=72, size=(120, 48))
    second = render_image("blue", "square", background="gray", seed=73, size=(40, 88))
    history = [user([first, second], Q_FIRST)]
    text, usage = answer(client, history)
    assert text == "red" and usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": Q_SECOND}]
    text, usage = answer(client, history)
    assert text == "blue" and usage.prompt_tokens_details.cached_tokens > 0


def test_same_image_to_llava_and_qwen_never_shares_an_encoder_output(client):
    img = render_image("green", "square", background="white", seed=74, size=(64, 64))
    # the third request's system message makes its prefix new: only the encoder cache can help it
    brief = {"role": "system", "content": "Answer briefly."}
    with structlog.testing.capture_logs() as logs:
        got = [answer(client, [*lead, user([img], Q_SHAPE)], model)[0]
               for model, lead in (("demo-qwen", []), ("demo", []), ("demo-qwen", [brief]))]
    assert got == ["square"] * 3
    events = [(e["event"], e["model"], e["key"]) for e in logs if e["event"] in ("encoder_cache.hit", "encoder_cache.miss")]
    assert [(ev, model) for ev, model, _ in events] == [
        ("encoder_cache.miss", "demo-qwen"), ("encoder_cache.miss", "demo"), ("encoder_cache.hit", "demo-qwen")]
    assert events[0][2] != events[1][2]
