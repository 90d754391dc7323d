"""Small tasks for the studies (plain JSONL rows and a reward file)."""
