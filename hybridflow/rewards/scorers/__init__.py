"""Rule-based scorers: `compute_score(solution_str, ground_truth, **options) -> float`.

Each is a pure function of the decoded response text and the row's ground truth,
returning 1.0 for a correct answer and 0.0 (or a small format score) otherwise.
"""
