"""What every process (gateway, scheduler, worker, and the launcher above them) runs with: its
bounded life and parent watch (lifetime), the stall watchdog, flag types and refusals, a
rate-limited log, and the metrics server. Below the processes: it imports none of them."""
