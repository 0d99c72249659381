"""Time one vramguard command in a child: wall, CPU (os.wait4: its own), peak RSS. Usage: vgtime.py SRC LABEL -- ARGS;
appends a JSON line to times.jsonl and writes the output to LABEL.out (PYTHONPATH=SRC)."""
import os, subprocess, sys, time, json
src, label = sys.argv[1], sys.argv[2]
args = sys.argv[sys.argv.index("--") + 1:]
env = dict(os.environ, PYTHONPATH=src)
t0 = time.perf_counter()
p = subprocess.Popen([sys.executable, "-m", "vramguard", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
out = p.stdout.read()
_, status, ru = os.wait4(p.pid, 0)
wall = time.perf_counter() - t0
rec = {"label": label, "src": src, "rc": os.waitstatus_to_exitcode(status), "wall_s": round(wall, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1), "rss_mib": ru.ru_maxrss // 1024, "load": os.getloadavg()[0], "args": args}
print(json.dumps(rec)); sys.stdout.flush()
open("times.jsonl", "a").write(json.dumps(rec) + "\n")
open(f"{label}.out", "wb").write(out)
