"""Repository tools for developers (doc generators and the house's floors), outside the installed
package: they read and write the checkout's files."""
