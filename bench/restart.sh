#!/bin/bash
# restart.sh N [ROUNDS]: what an agent restart costs with N running VMs.
#
# Starts `vmhost serve --simulate ch,qsd` (the simulators stand in for Cloud
# Hypervisor and qemu-storage-daemon) on a temporary state and run
# directory, creates N classic VMs with auto_boot (no interfaces), waits
# until all run, then ROUNDS times (default 5): SIGKILL the agent, start it
# again and time it from exec until it answers (the API answers once every
# VM is reconciled: adopted, here), and read the agent's CPU time at that
# moment (utime+stime of /proc/<pid>/stat; the simulators are other
# processes). Prints each round and the medians: seconds to every VM
# adopted, agent CPU in ms, and agent CPU per VM. Each round checks that the
# agent adopted all N VMs and ended none.
#
# With VMHOST_BEFORE=BINARY (another vmhost build, for instance of an
# earlier commit), the rounds alternate between it and VMHOST on the same
# VMs, and the medians are reported for each.
#
# With PROFILE=DIR, each restarted agent writes a CPU profile of its start
# to DIR/restart-<round>.prof (VMHOST_START_CPUPROFILE), for
# `go tool pprof -top VMHOST DIR/restart-1.prof`.
#
#   go build -o /tmp/vmhost . && VMHOST=/tmp/vmhost bench/restart.sh 1000
set -euo pipefail
n=${1:?usage: restart.sh N [ROUNDS]}
rounds=${2:-5}
vmhost=${VMHOST:-vmhost}
dir=$(mktemp -d /tmp/vhr.XXXX)
sock=$dir/api.sock
cleanup() {
	[ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true
	sleep 0.5
	pkill -KILL -f "$dir/run/" 2>/dev/null || true
	rm -rf "$dir"
}
trap cleanup EXIT
ulimit -n 65536 2>/dev/null || true
mkdir -p "$dir/state"
printf '{"host_cpus": %d, "host_memory_mb": %d, "host_path_roots": []}\n' "$n" $((n * 256)) >"$dir/config.json"
token=$("$vmhost" key add --state-dir "$dir/state" --name bench --scope readwrite | tail -1)
start_agent() { # [BINARY]
	"${1:-$vmhost}" serve --listen "unix:$sock" --state-dir "$dir/state" --run-dir "$dir/run" \
		--config "$dir/config.json" --simulate ch,qsd >>"$dir/agent.log" 2>&1 &
	pid=$!
}
api() { curl -sf --unix-socket "$sock" -H "Authorization: Bearer $token" "$@"; }
start_agent
until api http://x/api/vms >/dev/null 2>&1; do sleep 0.05; done
: >"$dir/kernel"
qemu-img create -q -f qcow2 "$dir/base.qcow2" 1G
export -f api
export sock token dir
seq -w 1 "$n" | xargs -P 4 -I{} bash -c 'api -o /dev/null -X POST http://x/api/vms -d "{\"vm_id\":\"r{}\",\"vcpus\":1,\"memory_mb\":64,\"kernel_path\":\"$dir/kernel\",\"disk\":{\"base_path\":\"$dir/base.qcow2\"},\"auto_boot\":true}"'
until [ "$(api http://x/api/vms | grep -o '"display_state":"running"' | wc -l)" -eq "$n" ]; do sleep 0.5; done
sleep 2
echo "$n VMs running; $rounds restarts"
cpu() { awk '{print ($14+$15)*10}' "/proc/$1/stat"; } # ms (USER_HZ 100)
sides=after
[ -n "${VMHOST_BEFORE:-}" ] && sides="before after"
for r in $(seq 1 "$rounds"); do
	for side in $sides; do
	bin=$vmhost
	[ "$side" = before ] && bin=$VMHOST_BEFORE
	kill -KILL "$pid"
	wait "$pid" 2>/dev/null || true
	: >"$dir/agent.log"
	r0=$(date +%s.%N)
	if [ -n "${PROFILE:-}" ]; then
		VMHOST_START_CPUPROFILE="$PROFILE/restart-$side-$r.prof" start_agent "$bin"
	else
		start_agent "$bin"
	fi
	until api -o /dev/null http://x/healthz 2>/dev/null; do sleep 0.002; done
	r1=$(date +%s.%N)
	c=$(cpu "$pid")
	adopted=$(grep -o 'adopted=[0-9]*' "$dir/agent.log" | head -1 | cut -d= -f2)
	ended=$(grep -c "VM ended" "$dir/agent.log" || true)
	if [ "${adopted:-0}" -ne "$n" ] || [ "$ended" -ne 0 ]; then
		echo "round $r: adopted ${adopted:-none} of $n, ended $ended" >&2
		tail -20 "$dir/agent.log" >&2
		exit 1
	fi
	awk -v r="$r" -v side="$side" -v r0="$r0" -v r1="$r1" -v c="$c" -v n="$n" 'BEGIN {
		printf "%s round %d: %.3f s to every VM adopted, agent CPU %d ms (%.3f ms per VM)\n", side, r, r1-r0, c, c/n }' | tee -a "$dir/rounds"
	sleep 3 # let the adopted agent settle before it is killed again
	done
done
for side in $sides; do
	grep "^$side " "$dir/rounds" | awk -v side="$side" -v n="$n" '{ t[NR]=$4; c[NR]=$12 }
	function median(a, k,   i, j, x) { for (i = 1; i <= k; i++) for (j = i + 1; j <= k; j++) if (a[j] < a[i]) { x = a[i]; a[i] = a[j]; a[j] = x } return k % 2 ? a[(k+1)/2] : (a[k/2] + a[k/2+1]) / 2 }
	END { printf "%s: median of %d: %.3f s to every VM adopted, agent CPU %.0f ms, %.3f ms per VM\n", side, NR, median(t, NR), median(c, NR), median(c, NR) / n }'
done
