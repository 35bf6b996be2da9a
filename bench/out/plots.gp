set terminal png size 1100,650 font ',10'
set grid
set key outside right
set output 'throughput.png'
set title 'Delivered vs offered packets/s (ChannelData over one allocation; dashed: 1200 B)'
set xlabel 'offered packets/s'
set ylabel 'delivered packets/s at the peer'
plot 
set output 'cpu.png'
set title 'Server CPU per relayed packet (process + softirq of all CPUs), log scale'
set logscale y
set ylabel 'µs per delivered packet'
plot 
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
