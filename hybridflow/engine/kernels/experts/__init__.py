"""The mixture-of-experts kernels: routing (softmax top-k, DeepSeek-V3's grouped sigmoid
routing), the sort of (row, expert) pairs into expert blocks, the grouped gate/up and down
matmuls with their combine (moe.py), and GPT-OSS's biased, clamped experts on the same
blocks. Importing this package needs only torch; each module imports Triton."""
