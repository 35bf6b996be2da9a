set terminal png size 1100,650 font ',10'
set grid
set key outside right
set output 'throughput.png'
set title 'Delivered vs offered packets/s (ChannelData over one allocation; dashed: 1200 B)'
set xlabel 'offered packets/s'
set ylabel 'delivered packets/s at the peer'
plot 'data/relay-0-100.dat' using 1:2 with linespoints lc 1 dt 1 pt 7 title 'stunnerd-xdp XDP native, 100 B', \
  'data/relay-0-1200.dat' using 1:2 with linespoints lc 1 dt 2 pt 7 title 'stunnerd-xdp XDP native, 1200 B', \
  'data/relay-1-100.dat' using 1:2 with linespoints lc 2 dt 1 pt 7 title 'stunnerd-xdp XDP generic, 100 B', \
  'data/relay-1-1200.dat' using 1:2 with linespoints lc 2 dt 2 pt 7 title 'stunnerd-xdp XDP generic, 1200 B', \
  'data/relay-2-100.dat' using 1:2 with linespoints lc 3 dt 1 pt 7 title 'stunnerd-xdp userspace (--xdp-mode=off), 100 B', \
  'data/relay-2-1200.dat' using 1:2 with linespoints lc 3 dt 2 pt 7 title 'stunnerd-xdp userspace (--xdp-mode=off), 1200 B', \
  'data/relay-3-100.dat' using 1:2 with linespoints lc 4 dt 1 pt 7 title 'stunnerd-xdp userspace, steered listener (--xdp-mode=off --handover-dir), 100 B', \
  'data/relay-3-1200.dat' using 1:2 with linespoints lc 4 dt 2 pt 7 title 'stunnerd-xdp userspace, steered listener (--xdp-mode=off --handover-dir), 1200 B', \
  'data/relay-4-100.dat' using 1:2 with linespoints lc 5 dt 1 pt 7 title 'STUNner stunnerd v1.1.0, 100 B', \
  'data/relay-4-1200.dat' using 1:2 with linespoints lc 5 dt 2 pt 7 title 'STUNner stunnerd v1.1.0, 1200 B', \
  'data/relay-5-100.dat' using 1:2 with linespoints lc 6 dt 1 pt 7 title 'coturn, 100 B', \
  'data/relay-5-1200.dat' using 1:2 with linespoints lc 6 dt 2 pt 7 title 'coturn, 1200 B', \
  'data/relay-6-100.dat' using 1:2 with linespoints lc 7 dt 1 pt 7 title 'kernel forwarding (no TURN), 100 B', \
  'data/relay-6-1200.dat' using 1:2 with linespoints lc 7 dt 2 pt 7 title 'kernel forwarding (no TURN), 1200 B', \
  'data/relay-7-100.dat' using 1:2 with linespoints lc 8 dt 1 pt 7 title 'delivery floor (server ns → peer, no relay), 100 B', \
  'data/relay-7-1200.dat' using 1:2 with linespoints lc 8 dt 2 pt 7 title 'delivery floor (server ns → peer, no relay), 1200 B'
set output 'cpu.png'
set title 'Server CPU per relayed packet (process + softirq of all CPUs), log scale'
set logscale y
set ylabel 'µs per delivered packet'
plot 'data/relay-0-100.dat' using 1:3 with linespoints lc 1 dt 1 pt 7 title 'stunnerd-xdp XDP native, 100 B', \
  'data/relay-0-1200.dat' using 1:3 with linespoints lc 1 dt 2 pt 7 title 'stunnerd-xdp XDP native, 1200 B', \
  'data/relay-1-100.dat' using 1:3 with linespoints lc 2 dt 1 pt 7 title 'stunnerd-xdp XDP generic, 100 B', \
  'data/relay-1-1200.dat' using 1:3 with linespoints lc 2 dt 2 pt 7 title 'stunnerd-xdp XDP generic, 1200 B', \
  'data/relay-2-100.dat' using 1:3 with linespoints lc 3 dt 1 pt 7 title 'stunnerd-xdp userspace (--xdp-mode=off), 100 B', \
  'data/relay-2-1200.dat' using 1:3 with linespoints lc 3 dt 2 pt 7 title 'stunnerd-xdp userspace (--xdp-mode=off), 1200 B', \
  'data/relay-3-100.dat' using 1:3 with linespoints lc 4 dt 1 pt 7 title 'stunnerd-xdp userspace, steered listener (--xdp-mode=off --handover-dir), 100 B', \
  'data/relay-3-1200.dat' using 1:3 with linespoints lc 4 dt 2 pt 7 title 'stunnerd-xdp userspace, steered listener (--xdp-mode=off --handover-dir), 1200 B', \
  'data/relay-4-100.dat' using 1:3 with linespoints lc 5 dt 1 pt 7 title 'STUNner stunnerd v1.1.0, 100 B', \
  'data/relay-4-1200.dat' using 1:3 with linespoints lc 5 dt 2 pt 7 title 'STUNner stunnerd v1.1.0, 1200 B', \
  'data/relay-5-100.dat' using 1:3 with linespoints lc 6 dt 1 pt 7 title 'coturn, 100 B', \
  'data/relay-5-1200.dat' using 1:3 with linespoints lc 6 dt 2 pt 7 title 'coturn, 1200 B', \
  'data/relay-6-100.dat' using 1:3 with linespoints lc 7 dt 1 pt 7 title 'kernel forwarding (no TURN), 100 B', \
  'data/relay-6-1200.dat' using 1:3 with linespoints lc 7 dt 2 pt 7 title 'kernel forwarding (no TURN), 1200 B', \
  'data/relay-7-100.dat' using 1:3 with linespoints lc 8 dt 1 pt 7 title 'delivery floor (server ns → peer, no relay), 100 B', \
  'data/relay-7-1200.dat' using 1:3 with linespoints lc 8 dt 2 pt 7 title 'delivery floor (server ns → peer, no relay), 1200 B'
unset logscale y
set output 'latency.png'
set title 'Round-trip time through the relay (echo at the peer)'
set style data histogram
set style histogram clustered gap 1
set style fill solid 0.8 border -1
set ylabel 'µs'
set xlabel ''
set xtics font ',8'
set logscale y
set bmargin 5
plot 'data/latency.dat' using 3:xtic(2) title 'p50', '' using 4 title 'p99', '' using 5 title 'p99.9'
unset logscale y
set style data linespoints
set xtics font ',10'
set bmargin
set output 'scaling.png'
set title 'XDP native: bound channels vs delivered rate and softirq CPU per packet'
set logscale x
set xlabel 'bound channels (all carrying traffic)'
set ylabel 'delivered packets/s'
set y2label 'softirq µs per packet'
set y2tics
set ytics nomirror
set yrange [0:*]
set y2range [0:*]
plot 'data/scaling-max.dat' using 1:3 axes x1y1 with linespoints pt 7 title 'delivered pps (max offered)', 'data/scaling-fixed.dat' using 1:3 axes x1y1 with linespoints pt 7 dt 2 title 'delivered pps (fixed rate)', 'data/scaling-max.dat' using 1:4 axes x1y2 with linespoints pt 5 title 'softirq µs/pkt (max offered)', 'data/scaling-fixed.dat' using 1:4 axes x1y2 with linespoints pt 9 dt 2 title 'softirq µs/pkt (fixed rate)'
