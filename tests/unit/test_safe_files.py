"""Files and directories the learner trusts only after checking: the publication directory
and Hugging Face model directories (checkpoints: test_checkpoint.py)."""

import os
import shutil
import stat

import pytest
import torch

from tests.helpers.safe_files_shared import model_copy, truncate  # noqa: F401  (fixtures)
from tsync_mcore.config import PublishConfig
from tsync_mcore.publication import send as publish
from tsync_mcore.publication.send import PublishDirError
from tsync_mcore.util.safe_files import ModelDirError, check_hf_dir


def test_symlinked_publish_dir_is_refused(tmp_path):
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "pub"
    link.symlink_to(target)
    with pytest.raises(PublishDirError, match=f"{link}: is a symlink"):
        publish.ensure_private_dir(str(link))


def test_world_writable_publish_dir_is_refused(tmp_path):
    d = tmp_path / "pub"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(PublishDirError, match=f"{d}: writable by group or others \\(mode 777"):
        publish.ensure_private_dir(str(d))
    assert stat.S_IMODE(d.stat().st_mode) == 0o777  # refused, not silently "fixed"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a directory to another user")
def test_publish_dir_of_another_user_is_refused(tmp_path):
    d = tmp_path / "pub"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(PublishDirError, match=f"{d}: owned by uid 65534"):
        publish.ensure_private_dir(str(d))


def test_default_publish_dir_is_private_and_per_run(tmp_path, monkeypatch):
    path = publish.resolve_dir(PublishConfig(), str(tmp_path / "run"))
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    assert os.path.basename(path).startswith(f"tsync-{os.getuid()}-")
    if base:
        assert os.path.dirname(path) == base
    # the same run dir however it is spelled gives the same directory; another run another
    monkeypatch.chdir(tmp_path)
    assert publish.resolve_dir(PublishConfig(), "run") == path
    assert publish.resolve_dir(PublishConfig(), str(tmp_path / "other")) != path
    assert publish.resolve_dir(PublishConfig(dir="pub"), "run") == str(tmp_path / "pub")
    try:
        publish.ensure_private_dir(path)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700
        publish.ensure_private_dir(path)  # found in place and private: accepted
    finally:
        shutil.rmtree(path, ignore_errors=True)


class _Exporter:
    """The two things publish.write asks of a policy: its layout and HF-named weights."""

    class par:
        rank, tp_size = 0, 1

    gathers_to_export = False  # one rank holds every weight (TP 1, EP 1)

    def export_params(self):
        return {"w": torch.arange(6.0).view(2, 3)}


def test_published_files_are_private(tmp_path):
    d = str(tmp_path / "pub")
    path = publish.write(_Exporter(), d, 3)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(d, 0o770)  # someone opened it up meanwhile: the next publication refuses
    with pytest.raises(PublishDirError, match="writable by group"):
        publish.write(_Exporter(), d, 4)
    assert not os.path.exists(publish.path_for(d, 4))


def _build(hf_dir: str, parallel1):
    from tsync_mcore.model.bridge import build_model
    return build_model(hf_dir)


def test_broken_config_json_is_named(model_copy, parallel1):
    d = model_copy("qwen2")
    open(os.path.join(d, "config.json"), "w").write("{")
    for check in (check_hf_dir, lambda p: _build(p, parallel1)):
        with pytest.raises(ModelDirError) as e:
            check(d)
        assert str(e.value).startswith(f"{d}/config.json: not valid JSON"), e.value


def test_config_json_with_wrong_types_is_named(model_copy, parallel1):
    import json
    d = model_copy("qwen2")
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg["hidden_size"] = "64"
    json.dump(cfg, open(path, "w"))
    why = f"{path}: hidden_size must be a positive integer, got"
    with pytest.raises(ModelDirError, match=f"{why} '64'"):
        _build(d, parallel1)
    del cfg["hidden_size"]
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ModelDirError, match=f"{why} None"):
        _build(d, parallel1)


@pytest.mark.parametrize("name,file", [("qwen2", "model.safetensors"),
                                       ("llama_tied", None)])
def test_truncated_safetensors_is_named(model_copy, parallel1, name, file):
    d = model_copy(name)
    file = file or sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))[-1]
    path = os.path.join(d, file)
    truncate(path)
    for check in (check_hf_dir, lambda p: _build(p, parallel1)):
        with pytest.raises(ModelDirError) as e:
            check(d)
        msg = str(e.value)
        assert msg.startswith(f"{path}: not a readable safetensors file") and "\n" not in msg


def test_index_naming_a_file_outside_the_dir_is_refused(model_copy):
    import json
    d = model_copy("llama_tied")
    index = os.path.join(d, "model.safetensors.index.json")
    wm = json.load(open(index))
    k = next(iter(wm["weight_map"]))
    wm["weight_map"][k] = "../elsewhere.safetensors"
    json.dump(wm, open(index, "w"))
    with pytest.raises(ModelDirError, match=f"{index}: weight_map must map"):
        check_hf_dir(d)


def test_private_dir_is_created_0700_and_an_open_one_of_ours_tightened(tmp_path):
    import stat as st

    from tsync_mcore.util.safe_files import private_dir

    fresh = tmp_path / "a" / "run"
    assert private_dir(str(fresh)) == str(fresh)
    assert st.S_IMODE(os.stat(fresh).st_mode) == 0o700
    opened = tmp_path / "open"
    opened.mkdir()
    os.chmod(opened, 0o755)
    private_dir(str(opened))
    assert st.S_IMODE(os.stat(opened).st_mode) == 0o700
