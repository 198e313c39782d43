"""The host side of generation: the scheduler and the steps it composes (admission, continuation, preemption, mixed steps), paging and read-back."""
