//go:build race

package endpoints

// raceSlowdown stretches the probe timeout of TestServeUnderIdleFlood under
// the race detector, which slows the server and the test's own flood of
// 1,000 goroutines (which on a node come from other machines) several times.
const raceSlowdown = 3
