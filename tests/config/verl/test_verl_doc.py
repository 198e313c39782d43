from hybridflow.config.verl.doc import BEGIN, DOC, END, mapping_table, with_table


def test_docs_hold_the_current_mapping_table():
    text = DOC.read_text()
    assert with_table(text) == text, "run: python -m hybridflow.config.verl.doc"


def test_table_lists_keys_and_what_they_become():
    table = mapping_table()
    assert "| `actor_rollout_ref.actor.optim.lr` | actor.lr |" in table
    assert "`actor_rollout_ref.actor.megatron.*` | stops: Megatron-LM" in table
    stale = f"x\n{BEGIN}\nold\n{END}\ny"
    assert with_table(stale) == f"x\n{BEGIN}\n{table}\n{END}\ny"
