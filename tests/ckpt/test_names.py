"""File names of the format."""
from nnscaler.ckpt.names import is_staging, merged_shard, rank_file, staging_prefix


def test_names():
    assert rank_file(3, 16) == "rank-00003-of-00016.safetensors"
    assert merged_shard(1, 2) == "model-00001-of-00002.safetensors"
    assert is_staging(staging_prefix("step-10") + "0123abcd") and not is_staging("step-10")
    assert not is_staging(".hidden")
