"""Multi-turn agent episodes with tools, token in and token out.

    loop = ToolCallingLoop(tokenizer, load_tools(["calculator", "python"]), SamplingParams())
    trajectories = asyncio.run(run_episodes(loop, episodes, EngineClient(engine)))

loop.py: Episode, Trajectory, the AgentLoop protocol and the built-in ToolCallingLoop;
parsers.py: tool calls out of generated text; tools.py: the Tool protocol, user tools from a
file, the built-in calculator and Python sandbox (sandbox.py); client.py: EngineClient, which
batches the episodes' requests into engine calls.
"""
