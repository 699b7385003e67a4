"""Phase 1 -> 2: the shard format (`shards`), the streaming reader (`reader`) and the corruption views
(`corruption`) that turn packed rows into the batches the objectives read (`batch`: the batch contract)."""
