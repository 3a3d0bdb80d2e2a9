//go:build !race

package hbone

// raceEnabled: this is a race build (rawio.go).
const raceEnabled = false
