#!/bin/bash
# The disk's native O_DIRECT read ceiling under kvtier's SSD cold get (docs/benchmarks.md, issue 19),
# measured with fio (io_uring), not with Python (scripts/ssd_ceiling.py stays below the device).
#
# Usage: scripts/ssd_read_ceiling_fio.sh [DIR] [ROUNDS] [BS_LIST] [QD_LIST] [JOBS_LIST]
#   defaults: DIR = ${TMPDIR:-/tmp}, 1 round, "256k 1m 2m 4m 8m", "1 4 8 16 32 64", "1 2"
#   then:     scripts/ssd_read_ceiling_fio.sh DIR sustained BS QD SECONDS
#
# Writes a 1 GiB file with O_DIRECT (fio, bs 2 MiB), then for each block size, queue depth and job
# count (one io_uring per job) reads 512 MiB of it with O_DIRECT (each job its own 512/jobs MiB
# slice), after fio's invalidate (POSIX_FADV_DONTNEED of the file). One line per read: bytes,
# GB/s (1e9 B/s), ms, fio's user/system CPU, the bytes anyone else moved on the file system's
# device during it (from /proc/diskstats), the load average. `sustained` reads for SECONDS and
# prints fio's 250 ms bandwidth windows. A measurement, not a test; needs fio (apt-get install fio).
set -euo pipefail
dir=${1:-${TMPDIR:-/tmp}}
file="$dir/kvtier-read-ceiling.bin"
dev=$(basename "$(df --output=source "$dir" | tail -1)")
io() { awk -v d="$dev" '$3==d {printf "%.0f\n", $6 + $10}' /proc/diskstats; }  # sectors read + written
[ -f "$file" ] || fio --name=w --filename="$file" --rw=write --direct=1 --bs=2m --size=1g \
    --ioengine=io_uring --iodepth=8 --output-format=terse >/dev/null
fio_json() { python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]; r=j['read']
print('%d B %.2f GB/s %d ms usr=%.1f%% sys=%.1f%%' % (r['io_bytes'], r['io_bytes']/r['runtime']/1e6,
      r['runtime'], j['usr_cpu'], j['sys_cpu']))"; }
if [ "${2:-}" = sustained ]; then
    bs=$3 qd=$4 secs=$5
    fio --name=s --filename="$file" --rw=read --direct=1 --bs="$bs" --size=1g --ioengine=io_uring \
        --iodepth="$qd" --time_based --runtime="$secs" --log_avg_msec=250 \
        --write_bw_log="$dir/kvtier-read-ceiling" --per_job_logs=0 --output-format=json | fio_json
    awk -F, '{printf "%.2f ", $2 * 1024 / 1e9} END {print "GB/s per 250 ms"}' "$dir/kvtier-read-ceiling_bw.log"
    exit 0
fi
for _ in $(seq "${2:-1}"); do
    for bs in ${3:-256k 1m 2m 4m 8m}; do for qd in ${4:-1 4 8 16 32 64}; do for nj in ${5:-1 2}; do
        per=$((512 / nj)) before=$(io)
        r=$(fio --name=r --filename="$file" --rw=read --direct=1 --bs="$bs" --size="${per}m" \
            --offset_increment="${per}m" --numjobs="$nj" --group_reporting --ioengine=io_uring \
            --iodepth="$qd" --invalidate=1 --output-format=json | fio_json)
        other=$(( ($(io) - before) * 512 / 1000000 - 536 ))
        echo "read bs=$bs qd=$qd jobs=$nj: $r other_io=${other}MB load=$(cut -d' ' -f1 /proc/loadavg)"
    done; done; done
done
