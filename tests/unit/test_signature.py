import inspect

import torch.utils.data

import coordl


def test_torch_parameters_come_first_in_torch_order_with_torch_defaults():
    ours = list(inspect.signature(coordl.DataLoader.__init__).parameters.values())
    theirs = list(inspect.signature(torch.utils.data.DataLoader.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[:len(theirs)]] == \
        [(p.name, p.kind, p.default) for p in theirs]


def test_coordl_options_are_keyword_only():
    params = inspect.signature(coordl.DataLoader.__init__).parameters
    extra = list(params)[len(inspect.signature(torch.utils.data.DataLoader.__init__).parameters):]
    assert extra == ["cache_bytes", "cache_name", "cache_verify", "drop_page_cache", "storage", "cache_dir",
                     "cache_dir_bytes", "cache_dir_verify", "progress", "backend",
                     "dali_pipeline", "dali_device", "dali_train", "hp_group", "hp_group_size", "hp_staging_bytes",
                     "hp_group_timeout_s", "hp_group_on_mismatch", "hp_group_key", "partitioned", "locality_aware",
                     "rehearsal"]
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in extra)
    assert params["cache_bytes"].default == "auto" and params["backend"].default == "torch"
    assert params["cache_verify"].default == "stat" and params["hp_group_key"].default is None
    assert params["partitioned"].default == "auto" and params["locality_aware"].default is False
    assert params["cache_dir"].default is None and params["cache_dir_bytes"].default == "auto"
    assert params["cache_dir_verify"].default == "checksum"


def test_the_class_is_generic_like_torchs():
    assert coordl.DataLoader[int] is not None  # a module annotated `-> DataLoader[Batch]` imports after the swap
