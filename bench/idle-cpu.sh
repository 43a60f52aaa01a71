#!/bin/bash
# idle-cpu.sh N [SECONDS]: the agent's own cost of N idle running VMs.
#
# Starts `vmhost serve --simulate ch,qsd` (the simulators stand in for Cloud
# Hypervisor and qemu-storage-daemon) on a temporary state and run
# directory, creates N classic VMs with auto_boot (no interfaces), waits
# until all run, then reads the agent's CPU time (utime+stime of
# /proc/<pid>/stat, the simulators excluded: they are other processes)
# over SECONDS (default 20). Prints CPU ms per second, RSS, goroutines per
# VM (from /metrics), the time of GET /api/vms, and the time from exec of
# a restarted agent (after SIGKILL) until every VM is adopted.
#
# As root the VMs run confined (each its own uid and cgroup); with
# EXTRA_CONFIG=',"jail":{"enabled":false}' they do not, for comparison.
#
#   go build -o /tmp/vmhost . && VMHOST=/tmp/vmhost bench/idle-cpu.sh 100
set -euo pipefail
n=${1:?usage: idle-cpu.sh N [SECONDS]}
secs=${2:-20}
vmhost=${VMHOST:-vmhost}
dir=$(mktemp -d /tmp/vhb.XXXX)
sock=$dir/api.sock
cleanup() {
	[ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true
	sleep 0.5
	pkill -KILL -f "$dir/run/" 2>/dev/null || true
	# The VMs' cgroups (of this agent only), once their processes are gone.
	agent=$(cat "$dir/state/agent_id" 2>/dev/null || true)
	if [ -n "$agent" ]; then
		sleep 0.5
		for h in /sys/fs/cgroup/*/vmhost/"$agent" /sys/fs/cgroup/vmhost/"$agent"; do
			[ -d "$h" ] && { rmdir "$h"/vm-* "$h" 2>/dev/null || true; }
		done
	fi
	rm -rf "$dir"
}
trap cleanup EXIT
mkdir -p "$dir/state"
printf '{"host_cpus": %d, "host_memory_mb": %d, "host_path_roots": []%s}\n' "$n" $((n * 256)) "${EXTRA_CONFIG:-}" >"$dir/config.json"
token=$("$vmhost" key add --state-dir "$dir/state" --name bench --scope readwrite | tail -1)
start_agent() {
	"$vmhost" serve --listen "unix:$sock" --state-dir "$dir/state" --run-dir "$dir/run" \
		--config "$dir/config.json" --simulate ch,qsd >>"$dir/agent.log" 2>&1 &
	pid=$!
}
api() { curl -sf --unix-socket "$sock" -H "Authorization: Bearer $token" "$@"; }
start_agent
until api http://x/api/vms >/dev/null 2>&1; do sleep 0.05; done
: >"$dir/kernel"
qemu-img create -q -f qcow2 "$dir/base.qcow2" 1G
t0=$(date +%s.%N)
for i in $(seq -w 1 "$n"); do
	api -o /dev/null -X POST http://x/api/vms -d "{\"vm_id\":\"b$i\",\"vcpus\":1,\"memory_mb\":64,\"kernel_path\":\"$dir/kernel\",\"disk\":{\"base_path\":\"$dir/base.qcow2\"},\"auto_boot\":true}"
done
t1=$(date +%s.%N)
until [ "$(api http://x/api/vms | grep -o '"display_state":"running"' | wc -l)" -eq "$n" ]; do sleep 0.2; done
sleep 2
cpu() { awk '{print $14+$15}' /proc/$pid/stat; }
c0=$(cpu); s0=$(date +%s.%N)
sleep "$secs"
c1=$(cpu); s1=$(date +%s.%N)
rss=$(awk '/VmRSS/{print $2}' /proc/$pid/status)
gor=$(api http://x/metrics | awk '$1=="go_goroutines"{print $2}')
heap=$(api http://x/metrics | awk '$1=="go_memstats_heap_alloc_bytes"{print $2}')
# The list's own time is curl's time_total (connect to last byte); the
# wall clock around curl adds its process start.
lt0=$(date +%s.%N); lt=$(api -o /dev/null -w '%{time_total}' http://x/api/vms); lt1=$(date +%s.%N)
views0=$(api http://x/api/vms | sed 's/"disk_bytes":[0-9]*//g')
kill -KILL "$pid"; wait "$pid" 2>/dev/null || true
r0=$(date +%s.%N)
start_agent
until api http://x/api/vms >/dev/null 2>&1; do sleep 0.005; done
r1=$(date +%s.%N)
views1=$(api http://x/api/vms | sed 's/"disk_bytes":[0-9]*//g')
restarted=$(grep -c "VM ended" "$dir/agent.log" || true)
awk -v n="$n" -v c0="$c0" -v c1="$c1" -v s0="$s0" -v s1="$s1" -v rss="$rss" -v gor="$gor" -v heap="$heap" \
	-v t0="$t0" -v t1="$t1" -v lt0="$lt0" -v lt1="$lt1" -v lt="$lt" -v r0="$r0" -v r1="$r1" -v restarted="$restarted" \
	-v same="$([ "$views0" = "$views1" ] && echo yes || echo no)" 'BEGIN {
	printf "vms %d: idle agent CPU %.1f ms/s over %.0f s, RSS %.1f MB (Go heap in use %.1f MB), %d goroutines (%.2f per VM)\n", n, (c1-c0)*10/(s1-s0), s1-s0, rss/1024, heap/1048576, gor, gor/n
	printf "  creates %.1f s (%.1f ms each, sequential), GET /api/vms %.1f ms (%.1f ms with curl'"'"'s own start)\n", t1-t0, (t1-t0)*1000/n, lt*1000, (lt1-lt0)*1000
	printf "  restart after SIGKILL: %.2f s to answering, VMs ended: %d, views identical: %s\n", r1-r0, restarted, same
}'
