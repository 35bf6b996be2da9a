//go:build !race

package endpoints

// raceSlowdown: see race_test.go.
const raceSlowdown = 1
