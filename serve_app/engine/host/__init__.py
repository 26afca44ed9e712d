"""Where the engine's step loop runs: on a thread of the serving process or in a process of its
own (`process`), the same loop (`step_loop`) either way, behind one async interface for serving
(`async_engine`)."""
