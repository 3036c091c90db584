"""Where the bytes lie: page sizes, the machine's nodes and CPUs, interleaved memory and
its page maps, and the periodic segment tables that say which part of a matrix is on
which node. Imports only the bottom floor (formats, files) and the native extension."""
