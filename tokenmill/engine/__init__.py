"""The engine: sequences, paged KV block manager, scheduler, model runner and the step loop."""
