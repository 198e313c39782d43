"""Test reward: the fraction of digits in the response. A random tiny model scores about
0.1 and varies a lot between samples, so every estimator has a learning signal."""


def digit_fraction(data_source, solution_str, ground_truth, extra_info=None):
    if not solution_str:
        return 0.0
    return sum(ch.isdigit() for ch in solution_str) / len(solution_str)
