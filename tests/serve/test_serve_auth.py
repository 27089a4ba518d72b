"""API keys: a real `flux-serve` with two keys from FLUX_SERVE_API_KEY (none, wrong, either right key, the
openai client; the probes open; /metrics behind the key; no key in the output, metrics or PNGs), the app in
process for `--metrics-public` and the header's forms, and the command's one-line errors."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from flux_runtime.serve import command
from flux_runtime.serve.app import ImageStore, Limits, create_app
from flux_runtime.serve.auth import ApiKeys
from tests.serve.server import Server

GEN = "/v1/images/generations"
KEYS = ("sk-first-2c1d9a", "sk-second-77e0f4")
SMALL = {"prompt": "a key", "size": "64x64", "steps": 1, "seed": 3}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server("--model", "tiny-random", store=tmp_path_factory.mktemp("s"),
                 env={"FLUX_SERVE_API_KEY": ",".join(KEYS)})  # fmt: skip
    yield srv
    srv.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_no_key_and_a_wrong_key_are_401_in_openais_shape(server):
    for headers, code in (({}, "missing_api_key"), (_bearer("sk-wrong"), "invalid_api_key")):
        for method, path in (("POST", GEN), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/v1/images/files/" + "0" * 32 + ".png"), ("GET", "/nowhere")):  # fmt: skip
            r = httpx.request(method, server.url + path, json=SMALL, headers=headers, timeout=30)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                          "param": None, "code": code}}  # fmt: skip
            assert "sk-" not in r.text  # neither the key sent nor one accepted


def test_either_key_is_let_in_and_the_probes_need_none(server):
    for key in KEYS:
        r = httpx.post(server.url + GEN, json=SMALL, headers=_bearer(key), timeout=120)
        assert r.status_code == 200, r.text
        assert b"sk-" not in base64.b64decode(r.json()["data"][0]["b64_json"])  # nor in the PNG's provenance
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200
    r = httpx.post(server.url + GEN, json=SMALL, headers={"Authorization": f"bearer  {KEYS[1]}"}, timeout=120)
    assert r.status_code == 200, r.text  # the scheme in any case, spaces around the key
    r = httpx.post(server.url + GEN, json=SMALL, headers={"Authorization": f"Basic {KEYS[0]}"}, timeout=30)
    assert r.status_code == 401


def test_the_openai_client_with_and_without_the_key(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEYS[0], max_retries=0)
    assert [m.id for m in good.models.list()] == ["tiny-random"]
    out = good.images.generate(prompt="a key", size="64x64", response_format="b64_json",
                               extra_body={"seed": 1, "steps": 1})  # fmt: skip
    assert out.data[0].b64_json
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-not-ours", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.images.generate(prompt="a key", size="64x64")
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"


def test_rejections_are_counted_and_no_key_is_in_the_metrics_or_the_output(server):
    httpx.post(server.url + GEN, json=SMALL, timeout=30)
    text = httpx.get(server.url + "/metrics", headers=_bearer(KEYS[1]), timeout=30).text
    assert 'flux_serve_requests_total{route="/v1/images/generations",status="401"}' in text
    assert "sk-" not in text
    server.stop()
    output = server.proc.stdout.read()
    assert output and not any(k in output for k in KEYS), output


def test_metrics_public_opens_only_metrics(tmp_path):
    def load():
        raise OSError("not needed")

    app = create_app(load, model="m", store=ImageStore(tmp_path, 1), limits=Limits(),
                     keys=ApiKeys.of(["sk-k"]), metrics_public=True)  # fmt: skip
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=_bearer("sk-k")).status_code == 200
    assert "sk-k" not in repr(ApiKeys.of(["sk-k"]))


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--api-key", ""], None, "Error: --api-key is empty"),
        (
            ["--api-key", "ok-key", "--api-key", "two words"],
            None,
            "Error: --api-key: key 2 of 2 holds whitespace",
        ),
        ([], "sk-a,", "Error: FLUX_SERVE_API_KEY: key 2 of 2 is empty"),
        ([], "", "Error: FLUX_SERVE_API_KEY is empty"),
        ([], "sk-a,\tsk-b", "Error: FLUX_SERVE_API_KEY: key 2 of 2 holds whitespace"),
        (
            [],
            "sk-caf\u00e9",
            "Error: FLUX_SERVE_API_KEY holds whitespace or a character other than printable",
        ),
    ],
)
def test_a_bad_key_is_one_line_at_start(monkeypatch, args, env, message):
    monkeypatch.setattr(command, "serve", lambda load, opts: command.api_keys(opts))  # no load, no port
    if env is None:
        monkeypatch.delenv("FLUX_SERVE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("FLUX_SERVE_API_KEY", env)
    result = CliRunner().invoke(command.main, ["--device", "cpu", *args])
    assert result.exit_code == 1
    assert result.output.startswith(message) and len(result.output.splitlines()) == 1, result.output
    assert "two words" not in result.output and "sk-" not in result.output


def test_api_key_options_take_the_place_of_the_environment(monkeypatch):
    monkeypatch.setenv("FLUX_SERVE_API_KEY", "sk-env-1,sk-env-2")
    opts = {"api_keys": ()}
    assert command.api_keys(opts) == ["sk-env-1", "sk-env-2"]
    assert command.api_keys({"api_keys": ("sk-opt",)}) == ["sk-opt"]


def test_an_open_port_without_a_key_is_one_warning(capsys):
    for host, keys, warned in (("127.0.0.1", [], False), ("::1", [], False), ("localhost", [], False),
                               ("0.0.0.0", [], True), ("gpu-box.lan", [], True), ("0.0.0.0", ["sk-k"], False)):  # fmt: skip
        command.warn_if_open({"host": host, "port": 8000}, keys)
        err = capsys.readouterr().err
        assert (err.count("\n") == 1 and "anyone who reaches port 8000" in err) if warned else err == "", host
