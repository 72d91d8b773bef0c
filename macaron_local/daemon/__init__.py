"""The nightly learning daemon: when to learn, and how it is scheduled by the OS.

One module per job:
- `config`: the daemon's and the learning run's settings (`[daemon]`, `[learn]` tables);
- `probes`: reading the machine's state (power, user idle time, load), each probe replaceable;
- `conditions`: the decision "may learning run now?", with a reason for every "no";
- `locks`: the single-instance lock and the "a chat reply is being generated" marker;
- `priority`: lowest CPU and IO priority for the learning process;
- `logs`: the rotating, private log file (secrets redacted);
- `history`: what recent `daemon run`s did, for `daemon status` and the app;
- `runner`: one `daemon run`: lock, conditions, learn, record;
- `units` / `service`: render the systemd or launchd files from `packaging/`, install them;
- `status`: what `daemon status` and the app's learning panel show;
- `watch`: the app's watchdog on the store, so a deployed adapter is noticed at once.
"""
