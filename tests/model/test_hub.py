"""Models by Hub id (asyncrl.model.hub) against a stand-in Hub on loopback (support.hub),
through the real huggingface_hub client: the download, offline resolution from the cache, and
the one-line errors for a wrong id, a wrong revision, a gated model and no network."""

from __future__ import annotations

import pytest
import torch

from asyncrl.model.hub import PERMANENT_EXIT, HubModelError, check, download, hub_model, main
from asyncrl.model.policy import TinyModelConfig, build_tiny_model, load_policy, load_tokenizer
from asyncrl.spec import ModelSpec
from support.hub import HubStandIn, point_huggingface_hub_at, write_tiny_hub_model

REPO = "tiny-org/tiny-chat"
TOKEN = "hf_stand_in_token"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_hub_model(tmp_path_factory.mktemp("repo"))


@pytest.fixture
def hub(model_folder):
    with HubStandIn() as server:
        server.add_model(REPO, model_folder, revisions=("main", "v1"))
        server.add_model("tiny-org/gated", model_folder, gated_token=TOKEN)
        yield server


@pytest.fixture
def cache(tmp_path, hub, monkeypatch):
    point_huggingface_hub_at(monkeypatch, hub, tmp_path / "hf")
    return tmp_path / "hf"


def test_a_hub_id_downloads_what_a_job_loads_into_the_cache(hub, cache, model_folder):
    directory = download(REPO)
    assert directory.is_relative_to(cache / "models--tiny-org--tiny-chat" / "snapshots")
    assert sorted(p.name for p in directory.iterdir()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
    assert (directory / "model.safetensors").read_bytes() == \
        (model_folder / "model.safetensors").read_bytes()
    # The job's policy and tokenizer load from it: the same weights as the model served.
    model, tokenizer = load_policy(ModelSpec(source=REPO))
    expected = build_tiny_model(TinyModelConfig(), vocab_size=len(load_tokenizer()))
    torch.testing.assert_close(model.state_dict(), expected.state_dict())
    assert tokenizer.encode("1 + 2 =") == load_tokenizer().encode("1 + 2 =")
    # A second resolution downloads nothing more.
    downloads = list(hub.repos[REPO].downloads)
    assert download(REPO) == directory
    assert hub.repos[REPO].downloads == downloads


def test_a_revision_is_downloaded_by_its_name(hub, cache):
    commit = hub.repos[REPO].refs["v1"]
    assert download(REPO, "v1").name == commit
    assert (cache / "models--tiny-org--tiny-chat" / "refs" / "v1").read_text() == commit


def test_offline_a_cached_model_resolves_without_the_hub(hub, cache, monkeypatch):
    online = download(REPO)
    hub.stop()
    point_huggingface_hub_at(monkeypatch, None, cache, offline=True)
    assert download(REPO) == online
    assert len(load_tokenizer(REPO)) == len(load_tokenizer())


def test_offline_a_model_not_in_the_cache_says_so_and_the_fix(cache, monkeypatch):
    point_huggingface_hub_at(monkeypatch, None, cache, offline=True)
    with pytest.raises(HubModelError) as error:
        download(REPO)
    assert not error.value.permanent
    assert str(error.value) == (
        f"model.source '{REPO}' (revision main) is not in the Hugging Face cache ({cache}) "
        "and HF_HUB_OFFLINE is set: unset HF_HUB_OFFLINE (or download it once online)")


def test_no_network_and_nothing_cached_is_one_error_naming_the_field(hub, cache):
    hub.stop()
    for ask in (download, check):
        with pytest.raises(HubModelError) as error:
            ask(REPO)
        message = str(error.value)
        assert not error.value.permanent
        assert message.startswith(f"model.source '{REPO}' (revision main) is not in the "
                                  f"Hugging Face cache ({cache}) and the Hub ({hub.url}) "
                                  "cannot be reached (ConnectError"), message
        assert message.endswith("connect to the network, or set HF_ENDPOINT to a mirror you "
                                "can reach")


@pytest.mark.parametrize("ask", [download, check])
def test_a_wrong_id_is_refused_naming_the_field_and_the_fix(hub, cache, ask):
    with pytest.raises(HubModelError) as error:
        ask("tiny-org/no-such-model")
    assert error.value.permanent
    assert str(error.value) == (
        f"model.source 'tiny-org/no-such-model': no such model on the Hub ({hub.url}), or it "
        "is private and no HF_TOKEN is set: check the id <org>/<name> on its Hub page, set "
        "HF_TOKEN for a private model, or write a local folder as a path "
        "(./tiny-org/no-such-model)")


@pytest.mark.parametrize("ask", [download, check])
def test_a_wrong_revision_is_refused_naming_the_field(hub, cache, ask):
    with pytest.raises(HubModelError) as error:
        ask(REPO, "v9")
    assert error.value.permanent
    assert str(error.value).startswith(f"model.revision 'v9' is no branch, tag or commit of "
                                       f"{REPO} on the Hub ({hub.url})")


@pytest.mark.parametrize("ask", [download, check])
def test_a_gated_model_needs_a_token_with_access(hub, cache, ask, monkeypatch):
    with pytest.raises(HubModelError) as error:
        ask("tiny-org/gated")
    assert error.value.permanent
    assert str(error.value) == (
        "model.source 'tiny-org/gated' is a gated model and no HF_TOKEN is set: accept its "
        f"terms on {hub.url}/tiny-org/gated, then set HF_TOKEN to a token of that account (in "
        "a cluster: model.hubTokenSecret)")
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(HubModelError, match="the token in HF_TOKEN has no access to it"):
        ask("tiny-org/gated")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    ask("tiny-org/gated")


def test_check_downloads_no_weights(hub, cache):
    check(REPO)
    assert hub.repos[REPO].downloads == []
    assert not (cache / "models--tiny-org--tiny-chat" / "snapshots").exists() or not any(
        (cache / "models--tiny-org--tiny-chat" / "snapshots").rglob("*.safetensors"))


def test_a_relative_path_that_exists_here_is_a_path(tmp_path, monkeypatch, model_folder):
    monkeypatch.chdir(tmp_path)
    assert hub_model(REPO) == REPO
    (tmp_path / "tiny-org").mkdir()
    (tmp_path / "tiny-org" / "tiny-chat").symlink_to(model_folder)
    assert hub_model(REPO) is None
    assert len(load_tokenizer(REPO)) == len(load_tokenizer())


def test_the_operators_download_writes_its_ready_file_or_exits_saying_why(hub, cache, tmp_path,
                                                                          capsys):
    ready = tmp_path / "volume" / "ready" / "abc"
    assert main(["tiny-org/gated", "main", str(ready)]) == PERMANENT_EXIT
    assert not ready.exists()
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "model.source 'tiny-org/gated' is a gated model")
    assert main([REPO, "main", str(ready)]) == 0
    assert ready.read_text().strip() == str(download(REPO))
    hub.stop()
    assert main(["tiny-org/other", "main", str(tmp_path / "other")]) == 1
    assert main([REPO, "main", str(ready)]) == 0  # done once: the Hub is not asked again
