from __future__ import annotations

import json
import os
import subprocess
import sys

from tandem.services.protocol.block_hash import HashSettings, hash_block, hash_token_blocks

TOKENS = list(range(1000, 1050))


def test_hashes_equal_in_a_process_with_another_hash_seed():
    code = (
        "import json, sys\n"
        "from tandem.services.protocol.block_hash import hash_token_blocks\n"
        "tokens = json.loads(sys.argv[1])\n"
        "print(json.dumps([h.hex() for h in hash_token_blocks(tokens, 16, ('m', 'salt'))]))\n"
    )
    here = [h.hex() for h in hash_token_blocks(TOKENS, 16, ("m", "salt"))]
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code, json.dumps(TOKENS)], env=env,
                             capture_output=True, text=True, check=True, timeout=60)
        assert json.loads(out.stdout) == here


def test_chaining_full_blocks_and_extra_keys():
    hashes = hash_token_blocks(TOKENS, 16, ("m",))
    assert len(hashes) == 3  # 50 tokens: the trailing 2 do not form a block
    assert hashes[1] == hash_block(hashes[0], TOKENS[16:32], ("m",))
    # Same block tokens under another parent hash differently (the chain carries the prefix).
    assert hash_block(None, TOKENS[16:32], ("m",)) != hashes[1]
    # Extra keys (model id, cache salt) separate tenants and models.
    assert hash_token_blocks(TOKENS, 16, ("m", "tenant-a"))[0] != hashes[0]
    assert hash_token_blocks(TOKENS, 16, ("other-model",))[0] != hashes[0]
    assert all(len(h) == 32 for h in hashes)


def test_settings_extra_keys():
    settings = HashSettings(block_size=16, model_id="m")
    assert settings.extra_keys() == ("m",)
    assert settings.extra_keys("salt") == ("m", "salt")
