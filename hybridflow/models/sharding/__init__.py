"""The model's layers spread over ranks: tensor, sequence (Ulysses), expert and vocabulary parallelism."""
